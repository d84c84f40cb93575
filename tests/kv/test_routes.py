"""The route words (`kv.routes`): a one-token context hands nothing off and a mode that prefills itself never
does; a repaired handoff's requests are served as repaired and every way is counted."""
import pytest

from pipeline.kv.modes import MODES, OWN_MODES
from pipeline.kv.routes import EMPTY_PREFIX, FELL_BACK, REPAIRED, hands_off, way, ways


@pytest.mark.parametrize("mode", MODES)
def test_a_one_token_context_hands_nothing_off_and_a_mode_that_prefills_itself_never_does(mode):
    assert not hands_off(mode, [5])
    assert hands_off(mode, [5, 6]) == (mode not in OWN_MODES)
    assert way(mode, False, [5], False) == (mode if mode in OWN_MODES else EMPTY_PREFIX)
    assert way(mode, False, [5, 6], True) == FELL_BACK
    assert (EMPTY_PREFIX in ways(mode, False, False)) == (mode not in OWN_MODES)


def test_a_repaired_handoff_serves_its_requests_as_repaired_and_counts_every_way():
    assert way("mapped", True, [5, 6], False) == REPAIRED
    assert ways("mapped", True, True) == [REPAIRED, EMPTY_PREFIX, FELL_BACK]
    assert ways("source", False, False) == ["source"]
