"""The maths of the repair's token selectors, one module each (`base.SelectorMaths` is what a maths module fills in),
keyed by the declarations' names (`kv/selectors/`); `registry` is the one list of them. Only the repair's run
(`kv.recompute`) imports them."""
