"""The report's studies: one module each, owning its input files, its statistics, its Markdown and its figure, so
adding a study is adding its module and its line in `registry`. `settings`, `format` and `run` hold what they share:
the `report` params, the formatting, and the run they all read with the protocol a study keeps.
"""
