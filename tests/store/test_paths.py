"""The shared folders' file names (`store.paths`): the repair's rows are file names without colons."""
from pathlib import Path


def test_paths_of_rows_are_file_names_without_colons():
    from pipeline.store import paths
    assert paths.repair_rows("items", "m", "sink:4+tokens:0.1:attention") == Path(
        "eval/repair/m/sink_4-tokens_0.1_attention.items.parquet")
