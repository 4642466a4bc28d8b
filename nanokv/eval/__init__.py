"""`nanokv eval`: quality against memory for KV policies (tasks x policies x compression)."""
