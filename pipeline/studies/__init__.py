"""The report's studies: one module each (listed in `registry`) with its inputs, statistics, Markdown and figure."""
