"""The gate's scores, one module each (`base.Score` is what a score module fills in); `registry` is the one list of
them."""
