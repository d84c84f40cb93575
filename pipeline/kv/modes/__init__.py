"""The handoff modes, one module each (`base.Mode` is what a mode module fills in); `registry` is the one list of
them."""
