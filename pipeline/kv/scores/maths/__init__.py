"""The maths of the gate's scores and of the probe's other inputs, one module each (`base.ScoreMaths` is what a maths
module fills in), keyed by the declarations' names (`kv/scores/`); `registry` is the one list of them. Only the gate
(`kv.gate`) imports them."""
