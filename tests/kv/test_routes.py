"""The route words (`kv.routes`): a one-token context hands nothing off and a mode that prefills itself never
does; a repaired handoff's requests are served as repaired and every way is counted; a cached request keeps the way
that first served it."""
import pytest

from pipeline.kv.modes import MODES, OWN_MODES
from pipeline.kv.routes import CACHED, EMPTY_PREFIX, REPAIRED, Route, way, ways


@pytest.mark.parametrize("mode", MODES)
def test_a_one_token_context_hands_nothing_off_and_a_mode_that_prefills_itself_never_does(mode):
    assert way(mode, False, [5]) == (mode if mode in OWN_MODES else EMPTY_PREFIX)
    assert way(mode, False, [5, 6]) == mode
    assert (EMPTY_PREFIX in ways(mode, False)) == (mode not in OWN_MODES)


def test_a_repaired_handoff_serves_its_requests_as_repaired_and_counts_every_way():
    assert way("mapped", True, [5, 6]) == REPAIRED
    assert way("mapped", True, [5]) == EMPTY_PREFIX
    assert ways("mapped", True) == [REPAIRED, EMPTY_PREFIX]
    assert ways("source", False) == ["source"]


def test_a_request_answered_from_the_cache_keeps_the_way_that_first_served_it():
    assert Route("direct").from_cache() == Route(CACHED, "direct")
    assert Route("direct").from_cache().from_cache() == Route(CACHED, "direct")
