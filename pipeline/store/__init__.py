"""Files and settings: checksummed artifacts, params, dtypes and devices, split names, real model shapes,
model loading, sharded KV caches."""
