"""The parameter classes of params.yaml, one module per stage (`schema/fit.py` is what stage `fit` reads). Importing
one loads no heavy library, so `check_params` validates the whole file without importing a stage. The sections shared
code reads are declared beside that code (`models` in store.models, `measure` in measure.settings, ...).
"""
