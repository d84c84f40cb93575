"""report.md from templates: the words live in `templates/` (`report.md.j2`, and `<module>.md.j2` per study), the
numbers in metrics/report.json. A section reads `study` (its key of report.json) and `shown` (its module's
`shown(study)`: tables, what the words choose between); the number formatters of `studies.format` are filters."""
from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from pipeline.studies import latency, operating, variants
from pipeline.studies.format import and_, interval, pct, pct_interval
from pipeline.studies.registry import STUDIES
from pipeline.studies.run import Run


def paragraph(text: str) -> str:
    """One Markdown paragraph however the template wraps it."""
    return " ".join(line.strip() for line in text.splitlines() if line.strip()) + "\n"


def code(value: object) -> str:
    return f"`{value}`"


ENV = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"), undefined=StrictUndefined,
                  trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
# `fmt`: Python's format spec (`x|fmt("+.2f")`, `n|fmt(",")`), as the f-strings the report was written with
ENV.filters.update(pct=pct, interval=interval, pct_interval=pct_interval, and_=and_, fmt=format, paragraph=paragraph,
                   code=code)


def template(key: str) -> str:
    return f"{STUDIES[key].__name__.rpartition('.')[2]}.md.j2"


def section(key: str, study: dict) -> str:
    return ENV.get_template(template(key)).render(study=study, shown=STUDIES[key].shown(study))


def head(report: dict, context: dict) -> str:
    return ENV.get_template("variants.md.j2").render(report=report, context=context,
                                                     shown=variants.shown(report, context))


def lookahead(select: dict) -> str:
    return ENV.get_template("lookahead.md.j2").render(select=select, shown=operating.lookahead(select))


def report(report: dict, run: Run, context: dict) -> str:
    """report.md. `context`: profile, data_kind, source, target, dtype, device, pair (`run.pair_names`),
    selected_name and environment (name -> value)."""
    sections = [(template(key), report[key], module.shown(report[key])) for key, module in STUDIES.items()
                if key in report]
    return ENV.get_template("report.md.j2").render(
        report=report, context=context, head=variants.shown(report, context), sections=sections,
        select=run.select, lookahead=operating.lookahead(run.select), controls=variants.controls(run.controls),
        latency=run.latency, latency_shown=None if run.latency is None else latency.shown(run.latency))
