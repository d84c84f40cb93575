"""The names of maps, in the fields each family declares (`kv.families.Family.name_fields`)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pipeline.kv.families import FAMILIES, FITTED_FAMILIES, family

DISTILLED_SUFFIX = "+kl"  # a distilled map's name: its start's name and this (`mlp_k3+kl`)
_FIELDS = {"k": (r"_k(?P<k>\d+)", "k{k}"), "rank": (r"_r(?P<rank>\d+)", "r{rank}"),
           "lambda": (r"_lam(?P<lam>[0-9.eE+-]+)", "lam{ridge_lambda:g}")}


@dataclass(frozen=True)
class MapName:
    """`<family>_k<k>[_r<rank>][_lam<lambda>][+kl]`; `+kl` for a map distilled from the map the rest names."""

    family: str
    k: int
    ridge_lambda: float | None = None
    rank: int | None = None
    distilled: bool = False

    def __str__(self) -> str:
        return self._joined(family(self.family).name_fields) + (DISTILLED_SUFFIX if self.distilled else "")

    @property
    def lambda_group(self) -> str:
        """The name without its lambda: the candidates a lambda is chosen among."""
        return self._joined(tuple(f for f in family(self.family).name_fields if f != "lambda"))

    def _joined(self, fields: tuple[str, ...]) -> str:
        return "_".join([self.family, *(_FIELDS[field][1].format(k=self.k, rank=self.rank,
                                                                 ridge_lambda=self.ridge_lambda) for field in fields)])

    @property
    def start(self) -> "MapName":
        """The fitted map a distilled map starts from."""
        return MapName(self.family, self.k, self.ridge_lambda, self.rank)

    @property
    def distilled_name(self) -> "MapName":
        return MapName(self.family, self.k, self.ridge_lambda, self.rank, distilled=True)

    @classmethod
    def parse(cls, text: str) -> "MapName":
        distilled = text.endswith(DISTILLED_SUFFIX)
        stem = text.removesuffix(DISTILLED_SUFFIX)
        for name in sorted(FITTED_FAMILIES, key=len, reverse=True):  # `low_rank_...` is not read as a family `low`
            pattern = re.escape(name) + "".join(_FIELDS[field][0] for field in FAMILIES[name].name_fields)
            match = re.fullmatch(pattern, stem)
            if match:
                lam, rank = match.groupdict().get("lam"), match.groupdict().get("rank")
                return cls(name, int(match["k"]), None if lam is None else float(lam),
                           None if rank is None else int(rank), distilled)
        forms = ", ".join(str(cls(name, 1, 0.001, 8)) for name in FITTED_FAMILIES)
        raise ValueError(f"{text!r} is not a map name (forms: {forms}; {DISTILLED_SUFFIX} after a distilled map's)")
