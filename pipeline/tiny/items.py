"""The tiny world's task items: HellaSwag- and PIQA-shaped items cut from fresh scenes, in lm-eval's schema, and their
rendering as lm-eval builds context and choices, shared by corpus and trainer: the models train on what is scored."""
from __future__ import annotations

import random

from pipeline.store.lazy import lazy
from pipeline.store.splits import content_hash
from pipeline.tiny import world
from pipeline.tiny.world import Fact, Scene, WorldConfig

pd = lazy("pandas")


def _item_context(rng: random.Random, cfg: WorldConfig) -> tuple[Scene, set[str], str]:
    """A task item's scene, the names it uses, and its context: the scene's facts, then a few statements."""
    scene = world.draw_scene(rng, cfg)
    used = {f.name for f in scene.facts}
    statements = world.draw_statements(rng, cfg, scene, rng.randint(*cfg.context_statements), used)
    return scene, used, world.join_parts(scene.text(), world.sentences(statements))


def hellaswag_item(rng: random.Random, cfg: WorldConfig, towns: dict, kind: str) -> dict:
    """ctx_b is the query, lowercase: lm-eval capitalizes it (str.capitalize lowercases the rest)."""
    scene, used, ctx_a = _item_context(rng, cfg)
    if kind == "recall":
        fact = rng.choice(scene.facts)
        same_colour = [f for f in scene.facts if f.colour == fact.colour and f != fact]
        others = [f for f in scene.facts if f.colour != fact.colour]
        rng.shuffle(same_colour), rng.shuffle(others)
        ctx_b, gold = f"later {fact.name}", f"{fact.colour} {fact.obj} ."
        wrong = [f"{f.colour} {f.obj} ." for f in (same_colour + others)[:3]]
    elif kind == "gist":
        obj = rng.choice(world.OBJECTS)
        ctx_b, gold = f"later {world.new_name(rng, used)}", f"{rng.choice(scene.palette)} {obj} ."
        wrong = [f"{rng.choice(p)} {obj} ." for p in world.PALETTES if p != scene.palette]
    else:
        fact = rng.choice(scene.facts)
        ctx_b, gold = f"later {fact.name} {fact.obj} from", f"{towns[fact.name, world.object_class(fact.obj)]} ."
        wrong = [f"{t} ." for t in _town_distractors(rng, towns, scene, fact, 3)]
    endings = wrong[:]
    label = rng.randint(0, 3)
    endings.insert(label, gold)
    return dict(activity_label=world.HELLASWAG_LABEL, ctx_a=ctx_a, ctx_b=ctx_b, ctx=f"{ctx_a} {ctx_b}", endings=endings,
                label=str(label), kind=kind)


def _town_distractors(rng: random.Random, towns: dict, scene: Scene, fact: Fact, n: int) -> list[str]:
    """Plausible wrong towns: the name's town for another object class, another scene name's town for this class,
    then any town; so only the memorized (name, class) pair picks the right one."""
    gold = towns[fact.name, world.object_class(fact.obj)]
    own = [towns[fact.name, c] for c in range(world.OBJECT_CLASSES) if c != world.object_class(fact.obj)]
    theirs = [towns[f.name, world.object_class(fact.obj)] for f in scene.facts if f != fact]
    rng.shuffle(own), rng.shuffle(theirs)
    pool = own[:1] + theirs[:1] + rng.sample(world.TOWNS, len(world.TOWNS))
    return list(dict.fromkeys(t for t in pool if t != gold))[:n]


def piqa_item(rng: random.Random, cfg: WorldConfig, towns: dict, kind: str) -> dict:
    """Also the generator of qa documents. A recall or gist answer restates the subject (`ann teal cup .`), so the
    two solutions differ only in the tokens the kind is about."""
    scene, used, context = _item_context(rng, cfg)
    if kind == "recall":
        fact = rng.choice(scene.facts)
        same_colour = [f for f in scene.facts if f.colour == fact.colour and f != fact]
        decoy = rng.choice(same_colour or [f for f in scene.facts if f != fact])
        question = f"what does {fact.name} have ?"
        answer, wrong = f"{fact.name} {fact.colour} {fact.obj} .", f"{fact.name} {decoy.colour} {decoy.obj} ."
    elif kind == "gist":
        name, obj = world.new_name(rng, used), rng.choice(world.OBJECTS)
        question = f"what does {name} have ?"
        other = rng.choice([p for p in world.PALETTES if p != scene.palette])
        answer, wrong = f"{name} {rng.choice(scene.palette)} {obj} .", f"{name} {rng.choice(other)} {obj} ."
    else:
        fact = rng.choice(scene.facts)
        # the answer does not restate the name and object: the key to the global fact stays in the context
        question = f"where is {fact.name} {fact.obj} from ?"
        answer = f"{towns[fact.name, world.object_class(fact.obj)]} ."
        wrong = f"{_town_distractors(rng, towns, scene, fact, 1)[0]} ."
    label = rng.randint(0, 1)
    sol = [wrong, answer] if label else [answer, wrong]
    return dict(goal=f"{context} {question}", sol1=sol[0], sol2=sol[1], label=label, kind=kind,
                facts=scene.text(), answer=answer)


def task_items(cfg: WorldConfig, task: str, part: str, n: int) -> pd.DataFrame:
    """n items of one task part in lm-eval's schema, plus kind, doc_id and content_hash (of the rendered context
    followed by the gold choice: the document the item was cut from)."""
    towns = world.global_towns(cfg.seed)
    rows = []
    for i in range(n):
        rng = world.stream(cfg, f"{task}-{part}", i)
        doc_id = f"{task}-{part}-{i:06d}"
        if task == "hellaswag":
            item = hellaswag_item(rng, cfg, towns, world.draw_kind(rng, cfg))
            item.update(ind=i, split=part, split_type="indomain", source_id=f"tinyworld~{doc_id}")
        else:  # piqa: the tasks are store.splits.TASKS
            item = piqa_item(rng, cfg, towns, world.draw_kind(rng, cfg))
            del item["facts"], item["answer"]
        query, choices, gold = (render_hellaswag if task == "hellaswag" else render_piqa)(item)
        rows.append(dict(item, doc_id=doc_id, content_hash=content_hash(f"{query} {choices[gold]}")))
    return pd.DataFrame(rows)


def render_hellaswag(item) -> tuple[str, list[str], int]:
    """lm-eval's context, choices and gold index (it scores " " + choice after the context). Our text has no
    brackets or double spaces, so lm-eval's preprocess only strips."""
    query = f"{item['activity_label']}: {item['ctx_a']} {item['ctx_b'].capitalize()}".strip()
    return query, [e.strip() for e in item["endings"]], int(item["label"])


def render_piqa(item) -> tuple[str, list[str], int]:
    return f"Question: {item['goal']}\nAnswer:", [item["sol1"], item["sol2"]], int(item["label"])
