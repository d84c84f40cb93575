"""The maths of the handoff modes, their prefix hooks, one module each (`base.ModeMaths` is what a maths module fills
in), keyed by the declarations' names (`kv/modes/`); `registry` is the one list of them. Only the handoff
(`kv.handoff`) imports them."""
