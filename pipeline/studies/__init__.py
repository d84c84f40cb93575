"""The report's studies: one module each (the V0 variants, every candidate, the calibration curve, the length
study), each owning its input files, its statistics, its Markdown and its figure; `settings` holds the
`report` params they share, `format` the formatting they share, `run` the run they all read and the protocol a
study keeps, `registry` the one list of them."""
