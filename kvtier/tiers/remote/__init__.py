"""The remote tier (issue 14): blocks shared between kvtier nodes through a Redis or Valkey
Cluster. `entry.py`: the key and the value of one block. The client and its place in the store
come next; nothing else imports this package yet."""
