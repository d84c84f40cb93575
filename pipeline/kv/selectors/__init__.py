"""The repair's token selectors, one module each (`base.Selector` is what a selector module fills in); `registry` is
the one list of them."""
