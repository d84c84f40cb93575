"""The mapper families, one module each (`base.Family` is what a family module fills in); `registry` is the one
list of them and the map names they make."""
