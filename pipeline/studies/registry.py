"""The report's studies beside the V0 variants (`variants`, the report's head), in the report's order. Adding a study
is adding its module (the `studies.run.Study` protocol), its template (`templates/<module>.md.j2`) and its line here;
a module that breaks the protocol, or joins a study not listed, is refused when this module loads."""
from __future__ import annotations

from types import ModuleType

from pipeline.studies import calibration, candidates, confident, distillation, length, operating, repair
from pipeline.studies.run import Joining, Study


def checked(studies: dict[str, ModuleType]) -> dict[str, Study]:
    for key, module in studies.items():
        if not isinstance(module, Study):
            missing = [name for name in ("load", "compute", "shown", "figure") if not hasattr(module, name)]
            raise TypeError(f"study {key!r} ({module.__name__}) lacks {', '.join(missing)} of the Study protocol "
                            f"(pipeline/studies/run.py): define them in the module")
        if hasattr(module, "join") != hasattr(module, "JOINS"):
            raise TypeError(f"study {key!r} ({module.__name__}) defines one of `join` and `JOINS`: a study that "
                            f"joins another defines both (studies.run.Joining)")
        if isinstance(module, Joining) and module.JOINS not in studies:
            raise TypeError(f"study {key!r} ({module.__name__}) joins {module.JOINS!r}, which is not a study of "
                            f"STUDIES ({', '.join(studies)}): list it in pipeline/studies/registry.py")
    return dict(studies)


STUDIES = checked({"confident": confident, "distillation": distillation, "candidates": candidates,
                   "repair": repair, "calibration": calibration, "length": length,
                   "lengths": operating})
