"""The remote tier (issue 14): blocks shared between kvtier nodes through a Redis or Valkey
Cluster. `entry.py`: the key and the value of one block. `cluster.py`: `RemoteCluster`, the
connection, where every failure of the cluster is a counted miss; `client.py`: its settings, and
the redis-py client made through one startup node. `liveness.py`: an idle node's probe of
the cluster, so that `connected` follows it. `paced.py`: a floor under the
pace of the cluster's replies. `tier.py`: `RemoteTier`, the face for one model layout: probe,
write and read blocks by their place on a path (seed and chained ids), from and into KV
tensors. `writer.py`: `RemoteWriter`, writes behind the caller. The store's side is
`transfer/remote.py`."""
