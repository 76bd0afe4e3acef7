"""A small English corpus composed in code, so the demo model needs no download.

Sentences and short chat exchanges are drawn from word lists with a seeded
``random.Random``: the same seed gives the same corpus on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ANIMALS = """cat dog horse fox owl bear wolf rabbit mouse goat sheep cow duck goose swan
heron eagle sparrow robin crow otter beaver badger deer moose whale dolphin seal turtle
frog snake lizard spider bee butterfly moth ant beetle salmon trout crab lobster""".split()
PEOPLE = """teacher farmer baker sailor doctor nurse painter poet miner pilot driver
gardener fisher builder singer dancer writer student child mother father sister brother
neighbour stranger merchant soldier captain judge scientist engineer librarian""".split()
THINGS = """boat house garden window door table chair lamp book letter map clock bell
bridge road river lake mountain forest meadow field village city tower castle market
harbour island valley hill stone tree flower apple bread cheese soup tea coffee cake
basket bottle blanket candle mirror ladder rope wheel engine train ship kite song story
picture question answer dream idea plan promise secret journey morning evening winter
summer autumn spring storm rain snow wind cloud sun moon star sky sea shore wave""".split()
ADJECTIVES = """old young small large quiet loud bright dark warm cold gentle brave clever
happy sad tired busy lazy careful curious strange simple quick slow heavy light green
blue red yellow golden silver wooden ancient modern early late soft hard empty full
friendly lonely patient honest proud calm wild kind tall short narrow wide deep""".split()
VERBS = """sees finds carries paints builds opens closes reads writes watches follows
remembers forgets visits cleans fixes sells buys bakes cooks sings draws counts
measures explores guards shares borrows returns lifts pulls pushes throws catches
hides chooses describes imagines notices studies teaches""".split()
INTRANSITIVE = """sleeps waits runs walks swims flies sings laughs dances rests listens
wanders travels works smiles whispers shouts hurries returns arrives leaves""".split()
ADVERBS = """slowly quickly quietly loudly gently carefully happily bravely calmly softly
suddenly often always sometimes rarely early late together alone again""".split()
PLACES = """near the river|by the sea|in the forest|on the hill|at the market|under the
bridge|behind the house|in the garden|across the field|inside the castle|beside the lake|
at the harbour|in the village|on the island|through the valley|along the road""".replace(
    "\n", " ").split("|")
TIMES = """in the morning|in the evening|at night|every day|on Sunday|on Monday|in winter|
in summer|after the storm|before dinner|at noon|once a week|last year|next spring""".replace(
    "\n", " ").split("|")
NAMES = """Ada Ben Clara David Elena Farid Greta Hugo Iris Jonas Kofi Lena Marco Nadia
Oscar Priya Quinn Rosa Sami Tara Umar Vera Wen Yusuf Zoe""".split()
TOPICS = ANIMALS[:20] + THINGS[:60]
NUMBER_WORDS = """one two three four five six seven eight nine ten eleven twelve twenty
hundred thousand""".split()


@dataclass(frozen=True, slots=True)
class ChatSample:
    user: str
    assistant: str
    system: str | None = None


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _noun_phrase(rng: random.Random) -> str:
    pool = rng.choice((ANIMALS, PEOPLE, THINGS))
    noun = rng.choice(pool)
    if rng.random() < 0.5:
        noun = f"{rng.choice(ADJECTIVES)} {noun}"
    determiner = rng.choice(("the", "the", "the", "a", "my", "our", "that"))
    return _a(noun) if determiner == "a" else f"{determiner} {noun}"


def _subject(rng: random.Random) -> str:
    return rng.choice(NAMES) if rng.random() < 0.3 else _noun_phrase(rng)


def sentence(rng: random.Random) -> str:
    """One plain declarative or descriptive sentence."""
    form = rng.randrange(6)
    subj = _subject(rng)
    if form == 0:
        text = f"{subj} {rng.choice(VERBS)} {_noun_phrase(rng)} {rng.choice(PLACES)}"
    elif form == 1:
        text = f"{subj} {rng.choice(INTRANSITIVE)} {rng.choice(ADVERBS)} {rng.choice(TIMES)}"
    elif form == 2:
        text = f"{subj} is {rng.choice(ADJECTIVES)} and {rng.choice(ADJECTIVES)}"
    elif form == 3:
        count = rng.choice((rng.choice(NUMBER_WORDS), str(rng.randrange(2, 1000))))
        plural = rng.choice(THINGS + ANIMALS)
        text = f"{subj} {rng.choice(VERBS)} {count} {plural}s {rng.choice(TIMES)}"
    elif form == 4:
        text = f"{rng.choice(TIMES)}, {subj} {rng.choice(INTRANSITIVE)} {rng.choice(PLACES)}"
    else:
        text = (f"{subj} {rng.choice(VERBS)} {_noun_phrase(rng)}, and then "
                f"{rng.choice(INTRANSITIVE)} {rng.choice(ADVERBS)}")
    return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "!"))


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(sentence(rng) for _ in range(sentences))


def chat_sample(rng: random.Random) -> ChatSample:
    topic = rng.choice(TOPICS)
    form = rng.randrange(4)
    if form == 0:
        user = rng.choice(("Tell me about", "Write a few lines about", "Describe")) + \
            f" the {topic}."
    elif form == 1:
        user = f"What does {_a(topic)} do {rng.choice(TIMES)}?"
    elif form == 2:
        user = f"Can you tell me a short story about {_a(rng.choice(ANIMALS))}?"
    else:
        user = f"Where is the {rng.choice(ADJECTIVES)} {topic}?"
    answer = f"The {topic} is {rng.choice(ADJECTIVES)}. " + paragraph(rng, rng.randint(1, 3))
    system = "You are a helpful assistant." if rng.random() < 0.2 else None
    return ChatSample(user=user, assistant=answer, system=system)


def corpus(seed: int, *, paragraphs: int = 600, chats: int = 400) -> list[str]:
    """Plain-text lines for tokenizer training (no special tokens)."""
    rng = random.Random(seed)
    lines = [paragraph(rng, rng.randint(1, 4)) for _ in range(paragraphs)]
    for _ in range(chats):
        sample = chat_sample(rng)
        lines += [sample.user, sample.assistant]
    # Every listed word at least once, so each can become a token of its own.
    words = ANIMALS + PEOPLE + THINGS + ADJECTIVES + VERBS + INTRANSITIVE + ADVERBS + NAMES
    lines += [" ".join(words), " ".join(w.capitalize() for w in words)]
    lines += [" ".join(str(n) for n in range(0, 1000, 7))]
    return lines
