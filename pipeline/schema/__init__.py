"""The parameter classes of params.yaml, one module per stage (`schema/fit.py` is what stage `fit` reads): the
sections' types, ranges, choices and rules, and the small helpers that read them (`FitParams.candidates()`, the
map names check_params compares). Importing one costs what its wing imports cost (no heavy library), so
`check_params` validates the whole file without importing a stage. The `models` section is `store.models`'s and
the `report` section `studies.settings`'s, where the wings that read them declare them."""
