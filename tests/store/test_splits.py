"""Split names and their disjointness (`store.splits`): a deliberate overlap is caught."""
import pandas as pd
import pytest

from pipeline.store.splits import OverlapError, check_disjoint


def test_deliberate_overlap_is_caught():
    fit = pd.DataFrame({"doc_id": ["a", "b"], "content_hash": ["1", "2"]})
    select = pd.DataFrame({"doc_id": ["c"], "content_hash": ["2"]})
    with pytest.raises(OverlapError, match="content_hash"):
        check_disjoint({"fit": fit, "select": select})
