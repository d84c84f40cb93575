"""The tiny world's training corpus and sequence sets, and every frame of the world (`generate_world`). A corpus
document carries its text and the character offset where its predictable part (the loss) starts: `story` and `qa`
documents are the rendered task forms, so the models train on exactly the text they are scored on; `bio` ones list
global facts; `copy` ones (words, `then`, the same words) teach the look-back first (`tiny.train`)."""
from __future__ import annotations

import random

from pipeline.store.lazy import lazy
from pipeline.store.splits import SEQUENCE_SPLITS, TASK_PARTS, TASKS, check_disjoint, content_hash
from pipeline.tiny import world
from pipeline.tiny.items import piqa_item, task_items
from pipeline.tiny.world import WorldConfig

pd = lazy("pandas")


def story_doc(rng: random.Random, cfg: WorldConfig, towns: dict) -> tuple[str, int]:
    scene = world.draw_scene(rng, cfg)
    used = {f.name for f in scene.facts}
    statements = world.draw_statements(rng, cfg, scene, rng.randint(*cfg.story_statements), used)
    if rng.random() < cfg.knowledge_doc_share:
        for _ in range(rng.randint(1, 2)):
            f = rng.choice(scene.facts)
            statement = f"later {f.name} {f.obj} from {towns[f.name, world.object_class(f.obj)]} ."
            statements.insert(rng.randint(0, len(statements)), statement)
    head = f"{world.HELLASWAG_LABEL}: {scene.text()}"
    return world.join_parts(head, world.sentences(statements)), len(head)


def qa_doc(rng: random.Random, cfg: WorldConfig, towns: dict) -> tuple[str, int]:
    item = piqa_item(rng, cfg, towns, world.draw_kind(rng, cfg))
    head = f"Question: {item['facts']}"
    return f"Question: {item['goal']}\nAnswer: {item['answer']}", len(head)


def bio_doc(rng: random.Random, cfg: WorldConfig, towns: dict) -> tuple[str, int]:
    lines = []
    for _ in range(rng.randint(*cfg.bio_lines)):
        name, obj = rng.choice(world.NAMES), rng.choice(world.OBJECTS)
        lines.append(f"{name} {obj} from {towns[name, world.object_class(obj)]} .")
    return "bio: " + " ".join(lines), 0


def copy_doc(rng: random.Random, cfg: WorldConfig) -> tuple[str, int]:
    words = world.NAMES + world.OBJECTS + tuple(c for p in world.PALETTES for c in p)
    string = " ".join(rng.choice(words) for _ in range(rng.randint(*cfg.copy_words)))
    head = f"copy: {string}"
    return f"{head} then {string}", len(head)


def _corpus_doc(rng: random.Random, cfg: WorldConfig, towns: dict) -> tuple[str, str, int]:
    u = rng.random()
    if u < cfg.story_share:
        return ("story", *story_doc(rng, cfg, towns))
    if u < cfg.story_share + cfg.qa_share:
        return ("qa", *qa_doc(rng, cfg, towns))
    if u < cfg.story_share + cfg.qa_share + cfg.bio_share:
        return ("bio", *bio_doc(rng, cfg, towns))
    return ("copy", *copy_doc(rng, cfg))


def corpus(cfg: WorldConfig) -> pd.DataFrame:
    """Training documents: doc_id, kind (story/qa/bio/copy), text, loss_from (chars), content_hash."""
    towns = world.global_towns(cfg.seed)
    rows = []
    for i in range(cfg.corpus_docs):
        kind, text, loss_from = _corpus_doc(world.stream(cfg, "corpus", i), cfg, towns)
        rows.append(dict(doc_id=f"corpus-{i:06d}", kind=kind, text=text, loss_from=loss_from,
                         content_hash=content_hash(text)))
    return pd.DataFrame(rows)


def sequences(cfg: WorldConfig, split: str, n: int) -> pd.DataFrame:
    """Held-out story and qa documents for fitting (fit), selecting (select) and evaluating (eval) maps."""
    towns = world.global_towns(cfg.seed)
    rows = []
    for i in range(n):
        rng = world.stream(cfg, split, i)
        kind = "story" if rng.random() < 0.5 else "qa"
        text, _ = (story_doc if kind == "story" else qa_doc)(rng, cfg, towns)
        rows.append(dict(doc_id=f"{split}-{i:06d}", kind=kind, text=text, content_hash=content_hash(text)))
    return pd.DataFrame(rows)


def generate_world(cfg: WorldConfig, sequences_per_split: dict[str, int],
                   items_per_part: int) -> dict[str, pd.DataFrame]:
    """Frames corpus, fit, select, eval (`sequences_per_split` documents each), hellaswag_dev, hellaswag_eval,
    piqa_dev, piqa_eval (`items_per_part` each), checked disjoint by document id and content hash."""
    frames = {"corpus": corpus(cfg), **{split: sequences(cfg, split, sequences_per_split[split])
                                       for split in SEQUENCE_SPLITS},
             **{f"{task}_{part}": task_items(cfg, task, part, items_per_part) for task in TASKS for part in TASK_PARTS}}
    check_disjoint(frames)
    return frames
