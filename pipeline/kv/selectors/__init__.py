"""The repair's token selectors, one declaration module each (`base.Selector` is what a selector module fills in)
and their maths, one module each in `maths/`; `registry` is the one list of them, `maths.registry` their maths."""
