"""How the `kv-transfer` lm-eval model served each request, and the `--use_cache` request cache, which keeps each
answer with the route that first served it (a later hit counts as `cached` with that way)."""
from __future__ import annotations

from typing import Callable

from lm_eval.api.model import hash_args
from sqlitedict import SqliteDict

from pipeline.kv.routes import CACHED, Route


class Ledger:
    """(task, doc id, request index) -> (route, repr of its args), and (context, continuation) ids of each
    log-likelihood request. A request seen twice (lm-eval's padding of a rank's requests) is one entry."""

    def __init__(self):
        self.entries: dict[tuple, tuple[Route, str]] = {}
        self.tokens: dict[tuple, tuple[list[int], list[int]]] = {}

    def record(self, request, route: Route, tokens: tuple[list[int], list[int]] | None = None) -> None:
        key = (request.task_name, request.doc_id, request.idx)
        self.entries[key] = (route, repr(request.args))
        if tokens is not None:
            self.tokens[key] = tokens

    def route(self, request) -> Route:
        return self.entries[(request.task_name, request.doc_id, request.idx)][0]

    def counts(self, ways: list[str]) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for (task, _, _), (route, _) in self.entries.items():
            tally = counts.setdefault(str(task), dict.fromkeys(["requests", *ways], 0))
            tally["requests"] += 1
            tally[route.way] = tally.get(route.way, 0) + 1
        return dict(sorted(counts.items()))

    def cached(self) -> dict[str, dict[str, int]]:
        """Per task with cached requests: how many of them each way first served."""
        counts: dict[str, dict[str, int]] = {}
        for (task, _, _), (route, _) in sorted(self.entries.items(), key=lambda entry: str(entry[0])):
            if route.way == CACHED:
                tally = counts.setdefault(str(task), {})
                tally[route.first] = tally.get(route.first, 0) + 1
        return dict(sorted(counts.items()))

    def by_document(self, keep: Callable[[list[Route]], bool]) -> dict[str, dict[str, dict[str, list]]]:
        """Per task and document, its requests' ways (and first ways of cached ones), where `keep` accepts them."""
        documents: dict[tuple[str, int], dict[int, Route]] = {}
        for (task, doc_id, index), (route, _) in self.entries.items():
            documents.setdefault((str(task), doc_id), {})[index] = route
        out: dict[str, dict[str, dict[str, list]]] = {}
        for (task, doc_id), requests in sorted(documents.items()):
            routes = [requests[index] for index in sorted(requests)]
            if keep(routes):
                entry = {"route": [route.way for route in routes]}
                if any(route.first is not None for route in routes):  # a cached request's first way
                    entry["first_served"] = [route.first for route in routes]
                out.setdefault(task, {})[str(doc_id)] = entry
        return out

    def gather(self, ranks) -> None:
        ledgers = ranks.gather((self.entries, self.tokens))
        if ledgers is not None:
            self.entries = {key: value for entries, _ in ledgers for key, value in entries.items()}
            self.tokens = {key: value for _, tokens in ledgers for key, value in tokens.items()}


class RequestCache:
    """One handoff's answers in sqlite, by lm-eval's request hash, with the route that first served each. `key` names
    the handoff (every model arg and content), so no other handoff reads it."""

    def __init__(self, base: str, key: str, rank: int = 0):
        self.path = f"{base}_kv-{key}_rank{rank}.db"
        self.entries = SqliteDict(self.path, autocommit=False)

    def serve(self, kind: str, requests: list, answer: Callable[[list], list], ledger: Ledger) -> list:
        """Each request's answer: from the cache where held (recorded as CACHED), else by `answer`, then stored."""
        keys = [hash_args(kind, request.args) for request in requests]
        held = [self.entries.get(key) for key in keys]
        fresh = [index for index, stored in enumerate(held) if stored is None]
        answers = [None if stored is None else stored[0] for stored in held]
        for index, result in zip(fresh, answer([requests[index] for index in fresh]) if fresh else []):
            answers[index] = result
            self.entries[keys[index]] = (result, ledger.route(requests[index]))
        for request, stored in zip(requests, held):
            if stored is not None:
                ledger.record(request, stored[1].from_cache())
        self.entries.commit()
        return answers


def count_lines(setting: str, counts: dict[str, dict[str, int]], cached: dict[str, dict[str, int]] | None = None
                ) -> list[str]:
    lines = [f"kv-transfer routes ({setting}):"]
    for task, tally in counts.items():
        ways = ", ".join(f"{count} {way}" for way, count in tally.items() if way != "requests")
        first = (cached or {}).get(task)
        if first:
            ways += " (first served: " + ", ".join(f"{count} {way}" for way, count in first.items()) + ")"
        lines.append(f"  {task}: {tally['requests']} requests: {ways}")
    return lines
