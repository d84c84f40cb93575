"""The tiny world: a seeded generator of a small synthetic language, its training corpus, its sequence
sets and its HellaSwag- and PIQA-shaped task items.

A *scene* is a handful of facts `NAME COLOUR OBJECT .` (names and objects unique in the scene). Every scene
has one of four topics, and the topic fixes a palette of three colours that all its facts use, so what a
scene is about can be read from any of its facts. Later sentences refer back to the scene:

    story: ann teal cup . bob sage box . ... Later bob sage box . Later ivy lime hat . Later ann cup from cairo .

- a *repeat* (`Later bob sage box .`) copies a fact: predicting it needs an exact match of one or two
  tokens (the name, then name and colour), the induction pattern tiny models learn quickly;
- a *novel* statement (`Later ivy lime hat .`) introduces a name absent from the scene with a colour from
  the topic's palette: predicting the colour needs the gist of the scene, not any single fact;
- a *knowledge* statement (`Later ann cup from cairo .`) names a town given by a global table, (name,
  object class) -> town, fixed across the whole corpus and never stated in a task item's context: the
  answer is held in the weights, keyed by what the context says.

These three give the item kinds `recall`, `gist` and `knowledge` of both task shapes. Items are cut from
fresh scenes in the rendered form lm-eval builds (see `render_hellaswag`, `render_piqa`), and the corpus
holds the same rendered forms (`story:` documents for HellaSwag, `Question: ...\\nAnswer: ...` documents
for PIQA), so the models are trained on exactly the text they are scored on. Two more document kinds help
training: `bio` documents list global facts, and `copy` documents (a random word string, `then`, the same
string again) teach the look-back first (see the feasibility notes, round 2).

All words of a class have the same length (names and objects 3 letters, colours 4, towns 5), so the
choices of an item have equal character length and lm-eval's acc_norm ranks them exactly like acc.

Every document is drawn from its own random stream, seeded by (world seed, split, index): the first n
documents of a larger draw are the smaller draw, and the splits cannot depend on each other.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from pydantic import ConfigDict, model_validator

from pipeline.store.lazy import lazy
from pipeline.store.params import Pair, Params, Positive, Share
from pipeline.store.splits import SEQUENCE_SPLITS, TASK_PARTS, TASKS, check_disjoint, content_hash

pd = lazy("pandas")

NAMES = (
    "ann", "bob", "tom", "sam", "eve", "amy", "ben", "dan", "ian", "joe",
    "kim", "leo", "max", "ned", "pam", "ray", "sue", "ted", "val", "zoe",
    "ada", "eli", "fay", "gus", "hal", "ivy", "jan", "kay", "lou", "mia",
    "nat", "oli", "pat", "rex", "roy", "tia", "una", "vic", "wes", "bea",
)
PALETTES = (
    ("blue", "navy", "teal"),
    ("pink", "rose", "ruby"),
    ("gold", "sand", "rust"),
    ("lime", "sage", "mint"),
)
OBJECTS = (
    "box", "cup", "hat", "pen", "mug", "key", "bag", "jar",
    "pot", "fan", "map", "cap", "toy", "bat", "bed", "bow",
)
TOWNS = (
    "cairo", "dubai", "lagos", "milan", "osaka", "quito", "perth", "turin", "delhi", "tokyo",
    "seoul", "miami", "boise", "omaha", "tulsa", "kyoto", "sofia", "minsk", "accra", "paris",
)
OBJECT_CLASSES = 4  # the town of a name depends on its object's index modulo this: 40 x 4 = 160 global facts
HELLASWAG_LABEL = "story"


class WorldConfig(Params):
    """Everything the generator draws from (params.yaml `data.world`); ranges are inclusive (low, high)."""

    model_config = ConfigDict(frozen=True)
    seed: int
    corpus_docs: Positive
    story_share: Share
    qa_share: Share
    bio_share: Share  # the rest of the corpus is copy documents
    facts: Pair
    story_statements: Pair
    context_statements: Pair  # statements between the facts and an item's query
    repeat_share: Share  # of statements; the rest introduce a new name
    knowledge_doc_share: Share  # story documents that state one or two global facts
    bio_lines: Pair
    copy_words: Pair
    recall_share: Share
    gist_share: Share  # of items and of qa documents; the rest are knowledge

    @model_validator(mode="after")
    def _consistent(self) -> "WorldConfig":
        for name in ("facts", "story_statements", "context_statements", "bio_lines", "copy_words"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a range [low, high] with 0 <= low <= high, got {[low, high]}")
        if self.facts[0] < 4 or self.facts[1] > len(OBJECTS):
            raise ValueError(f"facts must lie in [4, {len(OBJECTS)}] (distractors need 3 other facts), "
                             f"got {list(self.facts)}")
        if self.story_share + self.qa_share + self.bio_share > 1 or self.recall_share + self.gist_share > 1:
            raise ValueError("the shares of corpus kinds (story, qa, bio) and of item kinds (recall, gist) must "
                             "each sum to at most 1")
        return self


@dataclass(frozen=True)
class Fact:
    name: str
    colour: str
    obj: str


@dataclass(frozen=True)
class Scene:
    palette: tuple[str, str, str]
    facts: tuple[Fact, ...]

    def text(self) -> str:
        return " ".join(f"{f.name} {f.colour} {f.obj} ." for f in self.facts)


def object_class(obj: str) -> int:
    return OBJECTS.index(obj) % OBJECT_CLASSES


def global_towns(seed: int) -> dict[tuple[str, int], str]:
    """The global facts: (name, object class) -> town, four distinct towns per name."""
    rng = random.Random(f"{seed}/towns")
    return {(name, c): town for name in NAMES for c, town in enumerate(rng.sample(TOWNS, OBJECT_CLASSES))}


def _stream(cfg: WorldConfig, split: str, index: int) -> random.Random:
    return random.Random(f"{cfg.seed}/{split}/{index}")


def _scene(rng: random.Random, cfg: WorldConfig) -> Scene:
    n = rng.randint(*cfg.facts)
    palette = rng.choice(PALETTES)
    names, objs = rng.sample(NAMES, n), rng.sample(OBJECTS, n)
    return Scene(palette, tuple(Fact(nm, rng.choice(palette), ob) for nm, ob in zip(names, objs)))


def _statements(rng: random.Random, cfg: WorldConfig, scene: Scene, n: int, used: set[str]) -> list[str]:
    """n repeat or novel statements, lowercase; novel names are added to `used` so none is introduced twice."""
    out = []
    for _ in range(n):
        if rng.random() < cfg.repeat_share:
            f = rng.choice(scene.facts)
            out.append(f"later {f.name} {f.colour} {f.obj} .")
        else:
            name = _new_name(rng, used)
            out.append(f"later {name} {rng.choice(scene.palette)} {rng.choice(OBJECTS)} .")
    return out


def _new_name(rng: random.Random, used: set[str]) -> str:
    name = rng.choice(sorted(set(NAMES) - used))
    used.add(name)
    return name


def _sentences(statements: list[str]) -> str:
    return " ".join(s[0].upper() + s[1:] for s in statements)


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _kind(rng: random.Random, cfg: WorldConfig) -> str:
    u = rng.random()
    return "recall" if u < cfg.recall_share else "gist" if u < cfg.recall_share + cfg.gist_share else "knowledge"


# ---- corpus documents: text, and the character offset where the predictable part (the loss) starts ----

def story_doc(rng: random.Random, cfg: WorldConfig, towns: dict) -> tuple[str, int]:
    scene = _scene(rng, cfg)
    used = {f.name for f in scene.facts}
    statements = _statements(rng, cfg, scene, rng.randint(*cfg.story_statements), used)
    if rng.random() < cfg.knowledge_doc_share:
        for _ in range(rng.randint(1, 2)):
            f = rng.choice(scene.facts)
            statement = f"later {f.name} {f.obj} from {towns[f.name, object_class(f.obj)]} ."
            statements.insert(rng.randint(0, len(statements)), statement)
    head = f"{HELLASWAG_LABEL}: {scene.text()}"
    return _join(head, _sentences(statements)), len(head)


def qa_doc(rng: random.Random, cfg: WorldConfig, towns: dict) -> tuple[str, int]:
    item = _piqa_item(rng, cfg, towns, _kind(rng, cfg))
    head = f"Question: {item['facts']}"
    return f"Question: {item['goal']}\nAnswer: {item['answer']}", len(head)


def bio_doc(rng: random.Random, cfg: WorldConfig, towns: dict) -> tuple[str, int]:
    lines = []
    for _ in range(rng.randint(*cfg.bio_lines)):
        name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
        lines.append(f"{name} {obj} from {towns[name, object_class(obj)]} .")
    return "bio: " + " ".join(lines), 0


def copy_doc(rng: random.Random, cfg: WorldConfig) -> tuple[str, int]:
    words = NAMES + OBJECTS + tuple(c for p in PALETTES for c in p)
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
    towns = global_towns(cfg.seed)
    rows = []
    for i in range(cfg.corpus_docs):
        kind, text, loss_from = _corpus_doc(_stream(cfg, "corpus", i), cfg, towns)
        rows.append(dict(doc_id=f"corpus-{i:06d}", kind=kind, text=text, loss_from=loss_from,
                         content_hash=content_hash(text)))
    return pd.DataFrame(rows)


def sequences(cfg: WorldConfig, split: str, n: int) -> pd.DataFrame:
    """Held-out story and qa documents for fitting (fit), selecting (select) and evaluating (eval) maps."""
    towns = global_towns(cfg.seed)
    rows = []
    for i in range(n):
        rng = _stream(cfg, split, i)
        kind = "story" if rng.random() < 0.5 else "qa"
        text, _ = (story_doc if kind == "story" else qa_doc)(rng, cfg, towns)
        rows.append(dict(doc_id=f"{split}-{i:06d}", kind=kind, text=text, content_hash=content_hash(text)))
    return pd.DataFrame(rows)


# ---- task items ----

def _item_context(rng: random.Random, cfg: WorldConfig) -> tuple[Scene, set[str], str]:
    """A task item's scene, the names it uses, and its context: the scene's facts, then a few statements."""
    scene = _scene(rng, cfg)
    used = {f.name for f in scene.facts}
    statements = _statements(rng, cfg, scene, rng.randint(*cfg.context_statements), used)
    return scene, used, _join(scene.text(), _sentences(statements))


def _hellaswag_item(rng: random.Random, cfg: WorldConfig, towns: dict, kind: str) -> dict:
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
        obj = rng.choice(OBJECTS)
        ctx_b, gold = f"later {_new_name(rng, used)}", f"{rng.choice(scene.palette)} {obj} ."
        wrong = [f"{rng.choice(p)} {obj} ." for p in PALETTES if p != scene.palette]
    else:
        fact = rng.choice(scene.facts)
        ctx_b, gold = f"later {fact.name} {fact.obj} from", f"{towns[fact.name, object_class(fact.obj)]} ."
        wrong = [f"{t} ." for t in _town_distractors(rng, towns, scene, fact, 3)]
    endings = wrong[:]
    label = rng.randint(0, 3)
    endings.insert(label, gold)
    return dict(activity_label=HELLASWAG_LABEL, ctx_a=ctx_a, ctx_b=ctx_b, ctx=f"{ctx_a} {ctx_b}", endings=endings,
                label=str(label), kind=kind)


def _town_distractors(rng: random.Random, towns: dict, scene: Scene, fact: Fact, n: int) -> list[str]:
    """Plausible wrong towns: the name's town for another object class, another scene name's town for this
    class, then any town; so only the memorized (name, class) pair picks the right one."""
    gold = towns[fact.name, object_class(fact.obj)]
    own = [towns[fact.name, c] for c in range(OBJECT_CLASSES) if c != object_class(fact.obj)]
    theirs = [towns[f.name, object_class(fact.obj)] for f in scene.facts if f != fact]
    rng.shuffle(own), rng.shuffle(theirs)
    pool = own[:1] + theirs[:1] + rng.sample(TOWNS, len(TOWNS))
    return list(dict.fromkeys(t for t in pool if t != gold))[:n]


def _piqa_item(rng: random.Random, cfg: WorldConfig, towns: dict, kind: str) -> dict:
    """Also the generator of qa documents. A recall or gist answer restates the subject (`ann teal cup .`),
    so the two solutions differ only in the tokens the kind is about."""
    scene, used, context = _item_context(rng, cfg)
    if kind == "recall":
        fact = rng.choice(scene.facts)
        same_colour = [f for f in scene.facts if f.colour == fact.colour and f != fact]
        decoy = rng.choice(same_colour or [f for f in scene.facts if f != fact])
        question = f"what does {fact.name} have ?"
        answer, wrong = f"{fact.name} {fact.colour} {fact.obj} .", f"{fact.name} {decoy.colour} {decoy.obj} ."
    elif kind == "gist":
        name, obj = _new_name(rng, used), rng.choice(OBJECTS)
        question = f"what does {name} have ?"
        other = rng.choice([p for p in PALETTES if p != scene.palette])
        answer, wrong = f"{name} {rng.choice(scene.palette)} {obj} .", f"{name} {rng.choice(other)} {obj} ."
    else:
        fact = rng.choice(scene.facts)
        # the answer does not restate the name and object: the key to the global fact stays in the context
        question = f"where is {fact.name} {fact.obj} from ?"
        answer = f"{towns[fact.name, object_class(fact.obj)]} ."
        wrong = f"{_town_distractors(rng, towns, scene, fact, 1)[0]} ."
    label = rng.randint(0, 1)
    sol = [wrong, answer] if label else [answer, wrong]
    return dict(goal=f"{context} {question}", sol1=sol[0], sol2=sol[1], label=label, kind=kind,
                facts=scene.text(), answer=answer)


def task_items(cfg: WorldConfig, task: str, part: str, n: int) -> pd.DataFrame:
    """n items of one task part in lm-eval's schema, plus kind, doc_id and content_hash (of the rendered
    context followed by the gold choice: the document the item was cut from)."""
    towns = global_towns(cfg.seed)
    rows = []
    for i in range(n):
        rng = _stream(cfg, f"{task}-{part}", i)
        doc_id = f"{task}-{part}-{i:06d}"
        if task == "hellaswag":
            item = _hellaswag_item(rng, cfg, towns, _kind(rng, cfg))
            item.update(ind=i, split=part, split_type="indomain", source_id=f"tinyworld~{doc_id}")
        elif task == "piqa":
            item = _piqa_item(rng, cfg, towns, _kind(rng, cfg))
            del item["facts"], item["answer"]
        else:
            raise ValueError(f"unknown task {task!r}: the tiny world has 'hellaswag' and 'piqa' items")
        query, choices, gold = (render_hellaswag if task == "hellaswag" else render_piqa)(item)
        rows.append(dict(item, doc_id=doc_id, content_hash=content_hash(f"{query} {choices[gold]}")))
    return pd.DataFrame(rows)


def render_hellaswag(item) -> tuple[str, list[str], int]:
    """lm-eval's context, choices and gold index (it scores " " + choice after the context). Our text has
    no brackets or double spaces, so lm-eval's preprocess only strips."""
    query = f"{item['activity_label']}: {item['ctx_a']} {item['ctx_b'].capitalize()}".strip()
    return query, [e.strip() for e in item["endings"]], int(item["label"])


def render_piqa(item) -> tuple[str, list[str], int]:
    return f"Question: {item['goal']}\nAnswer:", [item["sol1"], item["sol2"]], int(item["label"])


def generate_world(cfg: WorldConfig, sequences_per_split: dict[str, int],
                   items_per_part: int) -> dict[str, pd.DataFrame]:
    """All frames of the world, keyed: corpus, fit, select, eval (as many documents as `sequences_per_split`
    says), hellaswag_dev, hellaswag_eval, piqa_dev, piqa_eval (`items_per_part` each). Checked disjoint by
    document id and content hash."""
    world = {"corpus": corpus(cfg)}
    for split in SEQUENCE_SPLITS:
        world[split] = sequences(cfg, split, sequences_per_split[split])
    for task in TASKS:
        for part in TASK_PARTS:
            world[f"{task}_{part}"] = task_items(cfg, task, part, items_per_part)
    check_disjoint(world)
    return world
