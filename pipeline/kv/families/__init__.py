"""The mapper families, one declaration module each (`base.Family` is what a family module fills in) and their maths,
one module each in `maths/`; `registry` is the one list of them and the map names they make, `maths.registry` their
maths."""
