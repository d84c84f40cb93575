"""The report's studies: one module each, owning its input files, statistics, Markdown and figure (the list is
`registry`); `settings`, `format` and `run` hold what they share: the `report` params, the formatting, the run."""
