"""The parameter classes of params.yaml, one module per stage (`schema/fit.py` is what stage `fit` reads): the sections'
types, ranges, choices and rules, and the small helpers that read them (`FitParams.candidates()`). Importing one costs
what its wing imports cost (no heavy library), so `check_params` validates the whole file without importing a stage.
The sections shared code reads are declared beside it: `models` (store.models), `machine` (store.machine), `measure`
(measure.settings), `speculative` (kv.speculative) and `report` (studies.settings).
"""
