"""The tiny world: a seeded generator of a small synthetic language of scenes and statements. Three statements give
the item kinds: a *repeat* copies a fact of the scene (`recall`: an exact look-back), a *novel* one gives a new name a
colour of the scene's palette (`gist`: what the scene is about, not any one fact), a *knowledge* one names the town a
fixed global table gives (`knowledge`: held in the weights). Each document has its own random stream (`stream`)."""
from __future__ import annotations

import random
from dataclasses import dataclass

from pydantic import ConfigDict, model_validator

from pipeline.store.params import Pair, Params, Positive, Share

# every word of a class has one length (names and objects 3 letters, colours 4, towns 5), so an item's choices have
# equal character length and lm-eval's acc_norm ranks them exactly like acc
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
    """A handful of facts `NAME COLOUR OBJECT .` (names and objects unique in the scene) whose colours all come from
    the palette of its topic (one of four), so what the scene is about can be read from any fact. Later sentences
    refer back to it: `story: ann teal cup . bob sage box . ... Later bob sage box . Later ivy lime hat . Later ann cup
    from cairo .` (a repeat, a novel statement, a knowledge statement)."""

    palette: tuple[str, str, str]
    facts: tuple[Fact, ...]

    def text(self) -> str:
        return " ".join(f"{f.name} {f.colour} {f.obj} ." for f in self.facts)


def object_class(obj: str) -> int:
    return OBJECTS.index(obj) % OBJECT_CLASSES


def global_towns(seed: int) -> dict[tuple[str, int], str]:
    """(name, object class) -> town, four distinct towns per name, fixed across the corpus and never stated in a task
    item's context: a knowledge answer is held in the weights, keyed by what the context says."""
    rng = random.Random(f"{seed}/towns")
    return {(name, c): town for name in NAMES for c, town in enumerate(rng.sample(TOWNS, OBJECT_CLASSES))}


def stream(cfg: WorldConfig, split: str, index: int) -> random.Random:
    """A document's own random stream, seeded by (world seed, split, index): the first n documents of a larger draw
    are the smaller draw, and the splits cannot depend on each other."""
    return random.Random(f"{cfg.seed}/{split}/{index}")


def draw_scene(rng: random.Random, cfg: WorldConfig) -> Scene:
    n = rng.randint(*cfg.facts)
    palette = rng.choice(PALETTES)
    names, objs = rng.sample(NAMES, n), rng.sample(OBJECTS, n)
    return Scene(palette, tuple(Fact(nm, rng.choice(palette), ob) for nm, ob in zip(names, objs)))


def draw_statements(rng: random.Random, cfg: WorldConfig, scene: Scene, n: int, used: set[str]) -> list[str]:
    """n repeat or novel statements, lowercase; novel names are added to `used`. A repeat needs an exact look-back
    (the induction pattern tiny models learn quickly); a novel statement's colour needs the gist of the scene."""
    out = []
    for _ in range(n):
        if rng.random() < cfg.repeat_share:
            f = rng.choice(scene.facts)
            out.append(f"later {f.name} {f.colour} {f.obj} .")
        else:
            name = new_name(rng, used)
            out.append(f"later {name} {rng.choice(scene.palette)} {rng.choice(OBJECTS)} .")
    return out


def new_name(rng: random.Random, used: set[str]) -> str:
    name = rng.choice(sorted(set(NAMES) - used))
    used.add(name)
    return name


def sentences(statements: list[str]) -> str:
    return " ".join(s[0].upper() + s[1:] for s in statements)


def join_parts(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def draw_kind(rng: random.Random, cfg: WorldConfig) -> str:
    u = rng.random()
    return "recall" if u < cfg.recall_share else "gist" if u < cfg.recall_share + cfg.gist_share else "knowledge"
