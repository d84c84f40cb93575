"""The maths of the mapper families, one module each (`base.FamilyMaths` is what a maths module fills in), keyed by
the declarations' names (`kv/families/`); `registry` is the one list of them. Only the mapper and the fitting wing
import them."""
