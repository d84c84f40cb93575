"""Every request's route through the `kv-transfer` lm-eval model (`measure.adapter`): how each of lm-eval's requests
was served (the words are `kv.routes`'), counted per task, listed per document and gathered over ranks.
"""
from __future__ import annotations

from typing import Callable

from pipeline.kv.routes import Route


class Ledger:
    """The route of every lm-eval Instance a model served: (task, doc id, request index) -> (route, repr of its
    args), and of each log-likelihood request the token ids it was scored on: (context, continuation). A request
    seen twice (lm-eval pads a rank's requests with copies of its last one) is one entry."""

    def __init__(self):
        self.entries: dict[tuple, tuple[Route, str]] = {}
        self.tokens: dict[tuple, tuple[list[int], list[int]]] = {}

    def record(self, request, route: Route, tokens: tuple[list[int], list[int]] | None = None) -> None:
        """`route` as the route of lm-eval's Instance `request`, and the `tokens` it was scored on where given."""
        key = (request.task_name, request.doc_id, request.idx)
        self.entries[key] = (route, repr(request.args))
        if tokens is not None:
            self.tokens[key] = tokens

    def counts(self, ways: list[str]) -> dict[str, dict[str, int]]:
        """Per task: its requests and how many went each way (every one of `ways`, zeros included: a gate that never
        fires shows `fell_back: 0`)."""
        counts: dict[str, dict[str, int]] = {}
        for (task, _, _), (route, _) in self.entries.items():
            tally = counts.setdefault(str(task), dict.fromkeys(["requests", *ways], 0))
            tally["requests"] += 1
            tally[route.way] = tally.get(route.way, 0) + 1
        return dict(sorted(counts.items()))

    def by_document(self, keep: Callable[[list[Route]], bool]) -> dict[str, dict[str, dict[str, list]]]:
        """Per task and document (its id as text), its requests' ways (and gate scores, where gated) in request
        order, for the documents whose routes `keep` accepts."""
        documents: dict[tuple[str, int], dict[int, Route]] = {}
        for (task, doc_id, index), (route, _) in self.entries.items():
            documents.setdefault((str(task), doc_id), {})[index] = route
        out: dict[str, dict[str, dict[str, list]]] = {}
        for (task, doc_id), requests in sorted(documents.items()):
            routes = [requests[index] for index in sorted(requests)]
            if keep(routes):
                entry = {"route": [route.way for route in routes]}
                if any(route.score is not None for route in routes):  # a gated request's score
                    entry["gate_score"] = [route.score for route in routes]
                out.setdefault(task, {})[str(doc_id)] = entry
        return out

    def gather(self, ranks) -> None:
        """Every rank's entries merged into rank 0's (`ranks`: a `store.ranks.Ranks`; lm-eval gives each rank every
        N-th document); in one process, nothing changes."""
        ledgers = ranks.gather((self.entries, self.tokens))
        if ledgers is not None:
            self.entries = {key: value for entries, _ in ledgers for key, value in entries.items()}
            self.tokens = {key: value for _, tokens in ledgers for key, value in tokens.items()}


def count_lines(setting: str, counts: dict[str, dict[str, int]]) -> list[str]:
    """The counts as the `run` command prints them: one line for the `setting`, one per task."""
    lines = [f"kv-transfer routes ({setting}):"]
    for task, tally in counts.items():
        ways = ", ".join(f"{count} {way}" for way, count in tally.items() if way != "requests")
        lines.append(f"  {task}: {tally['requests']} requests: {ways}")
    return lines
