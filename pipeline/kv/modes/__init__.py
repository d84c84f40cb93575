"""The handoff modes, one declaration module each (`base.Mode` is what a mode module fills in) and their maths (the
prefix hooks), one module each in `maths/`; `registry` is the one list of them, `maths.registry` their maths."""
