"""The calibration curve's points: the one on the fit split itself takes the main fit's maps, every other point
fits its own."""
import pandas as pd

from pipeline import calibrate


def pool_and_fit_split(folder, fit_sequences: int) -> pd.DataFrame:
    """A pool of six sequences under folder/data/calibration.parquet whose first `fit_sequences` are the fit split."""
    pool = pd.DataFrame({"doc_id": range(6), "token_ids": [[i, i + 1] for i in range(6)]})
    (folder / "data").mkdir()
    pool.to_parquet(folder / "data" / "calibration.parquet", index=False)
    pool.head(fit_sequences).to_parquet(folder / "data" / "fit.parquet", index=False)
    return pd.read_parquet(folder / "data" / "calibration.parquet")


def test_only_the_point_on_the_fit_split_itself_is_recognized_as_the_main_fits_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pool = pool_and_fit_split(tmp_path, fit_sequences=4)
    assert calibrate.is_fit_split(pool.head(4))
    assert not calibrate.is_fit_split(pool.head(3)) and not calibrate.is_fit_split(pool.head(5))
    changed = pool.head(4).copy()
    changed.at[2, "token_ids"] = [9, 9]
    assert not calibrate.is_fit_split(changed)
