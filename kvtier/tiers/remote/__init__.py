"""The remote tier (issue 14): blocks shared between kvtier nodes through a Redis or Valkey
Cluster. `entry.py`: the key and the value of one block. `cluster.py`: `RemoteCluster`, the
connection, where every failure of the cluster is a counted miss. Its place in the store (index
hints, lookups that extend into it, the mover's writes, config, status) comes next; nothing
else imports this package yet."""
