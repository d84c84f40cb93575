"""The gate's scores, one declaration module each (`base.Score` is what a score module fills in) and their maths, one
module each in `maths/`; `registry` is the one list of them, `maths.registry` their maths."""
