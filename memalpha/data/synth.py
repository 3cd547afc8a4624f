"""Offline, seeded synthetic benchmark covering the four memory competencies.

Each instance is a multi-session dialogue between two named speakers with dated sessions, varied
phrasings and small talk. The generator plans one "slot" per requested chunk: distractor slots hold only
small talk, the others also carry the instance's facts (in story order), and every slot is filled with
small talk up to the chunk budget. The turns then go through the same chunker as real data (each slot
starts a new chunk), so evidence chunk indices come from where the fact turns actually landed.

Every gold answer is a short string that occurs literally in the dialogue, so a small model can learn to
store it, and the answer pools never overlap the small-talk vocabulary."""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from memalpha.data.chunking import DIALOGUE_HEADER, TokenCounts, Turn, chunk_turns
from memalpha.data.schema import Instance, Question
from memalpha.rewards.question_types import COMPETENCIES
from memalpha.tokens import regex_token_count

GENERATOR = "memalpha-synth-1"


@dataclass(frozen=True)
class SynthConfig:
    """Generator knobs. `chunks_per_instance` is cycled over instances (so one set can hold several
    lengths); competencies are cycled too, each length getting every competency in turn."""

    instances: int = 16
    chunks_per_instance: tuple[int, ...] = (6,)
    chunk_tokens: int = 512
    facts_per_instance: int = 6
    distractor_share: float = 0.3
    updates_per_fact: int = 2
    competencies: tuple[str, ...] = COMPETENCIES
    seed: int = 0

    def __post_init__(self):
        problems = []
        if self.instances < 1:
            problems.append("instances must be >= 1")
        if not self.chunks_per_instance or min(self.chunks_per_instance) < 1:
            problems.append("chunks_per_instance must be >= 1")
        if self.chunk_tokens < 128:
            problems.append("chunk_tokens must be >= 128")
        if self.facts_per_instance < 1:
            problems.append("facts_per_instance must be >= 1")
        if not 0 <= self.distractor_share < 1:
            problems.append("distractor_share must be in [0, 1)")
        if self.updates_per_fact < 1:
            problems.append("updates_per_fact must be >= 1")
        unknown = [c for c in self.competencies if c not in COMPETENCIES]
        if unknown or not self.competencies:
            problems.append(f"competencies must be among {', '.join(COMPETENCIES)} (got {list(self.competencies)})")
        if problems:
            raise ValueError("invalid synthetic data settings: " + "; ".join(problems))


PRESETS = {
    "train": SynthConfig(instances=256, chunks_per_instance=(4, 6, 8, 12), chunk_tokens=512, facts_per_instance=6),
    "longgen": SynthConfig(instances=16, chunks_per_instance=(8, 32, 128, 244), chunk_tokens=2048, facts_per_instance=12,
                           distractor_share=0.5),
}
"""`train`: instances of 2-6K tokens (the paper trains below 30K). `longgen`: length generalisation,
16K to 500K tokens per instance."""

# ---------------------------------------------------------------- vocabulary (answer pools are disjoint
# from the small-talk words below)
NAMES = ("Alice Bruno Clara Dmitri Elena Farid Greta Hiro Ines Jonas Keiko Luca Maya Nadia Oscar Priya Quentin "
         "Rosa Samir Tessa Umar Vera Wendell Ximena Yusuf Zoe Amara Bastian Celine Dario Esme Felix Gwen Hector "
         "Ingrid Javier Kira Leon Mirela Nico Olga Pavel Rhea Stellan Tamsin Ulla Viktor Wren Yara Zeno").split()
CITIES = ("Lisbon Porto Valencia Bilbao Lyon Marseille Bordeaux Ghent Utrecht Leipzig Dresden Bremen Salzburg Graz "
          "Ljubljana Zagreb Krakow Gdansk Tallinn Riga Vilnius Bergen Aarhus Uppsala Turku Galway Cork Glasgow Leeds "
          "Bristol Halifax Quebec Denver Austin Portland Tucson Savannah Boise Madison Tacoma Adelaide Hobart Perth "
          "Wellington Nelson Kyoto Sapporo Busan Tainan Cusco").split()
JOBS = ("nurse;architect;pastry chef;data analyst;librarian;paramedic;carpenter;pharmacist;translator;electrician;"
        "veterinarian;sound engineer;florist;tax advisor;park ranger;dental hygienist;welder;speech therapist;"
        "court reporter;museum curator;surveyor;midwife;locksmith;radio producer;glassblower").split(";")
COMPANIES = [f"{a} {b}" for a in "Bluefin Northwind Copperleaf Silverline Redwood Brightpath Ironbridge Greenfield "
             "Starling Larkspur".split() for b in "Analytics Logistics Studios Labs Robotics Media Health Energy".split()]
PET_KINDS = ("dog", "cat", "parrot", "rabbit", "tortoise", "hamster", "ferret", "gecko")
PET_NAMES = ("Biscuit Pickle Mochi Waffles Pepper Noodle Ziggy Clementine Juniper Pistachio Marbles Turnip Gizmo "
             "Sprocket Dumpling Sherbet Bramble Nugget Truffle Pancake Wasabi Tofu Custard Crumpet").split()
INSTRUMENTS = ("cello", "banjo", "clarinet", "ukulele", "trombone", "harp", "accordion", "oboe", "mandolin", "viola")
CAR_COLORS = ("red", "teal", "silver", "mustard yellow", "dark green", "navy blue", "white", "orange")
CARS = ("hatchback", "pickup truck", "station wagon", "electric scooter", "motorbike", "camper van")
BOOK_ADJ = "Silent Crimson Hollow Gilded Restless Distant Paper Winter Borrowed Second".split()
BOOK_NOUN = "Lighthouse Orchard Cartographer Harbor Violin Almanac Meridian Lantern Tide Archive".split()
ALLERGIES = ("sesame", "kiwi", "shellfish", "penicillin", "hazelnuts", "latex", "mustard seed", "celery")
CLUBS = ("rowing", "fencing", "climbing", "chess", "archery", "salsa", "pottery", "birdwatching", "curling")
MONTHS = ("January February March April May June July August September October November December").split()
RELATIONS = ("cousin", "neighbour", "brother", "sister", "colleague", "roommate", "aunt", "uncle", "best friend")

# ---------------------------------------------------------------- accurate retrieval / conflict facts
# kind -> (statement templates, question template, value pool name)
AR_KINDS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "pet": (("I adopted a {kind} last week, we named him {v}.", "Our new {kind} is called {v}, he is a little chaotic.",
             "Meet the newest family member: a {kind} named {v}!"), "What is the name of {x}'s {kind}?", "pet"),
    "job": (("I just started working as a {v}.", "So I finally got hired as a {v}, first week went fine.",
             "Did I tell you I retrained? I'm a {v} now."), "What job does {x} have?", "job"),
    "employer": (("I accepted the offer from {v}, I start on Monday.", "I signed the contract with {v} yesterday.",
                  "Guess who's the newest employee at {v}? Me!"), "Which company did {x} join?", "company"),
    "instrument": (("I've been taking {v} lessons on Tuesdays.", "I bought a second-hand {v} and I'm learning to play it.",
                    "My teacher says my {v} playing is improving."), "Which instrument is {x} learning?", "instrument"),
    "book": (("I'm halfway through a novel called {v}.", "I can't put down {v}, the novel you recommended ages ago.",
              "Book club picked {v} this month."), "Which novel is {x} reading?", "book"),
    "car": (("I finally bought a {v}.", "We traded the old car for a {v}.", "Picked up my {v} from the dealer today."),
            "What vehicle did {x} buy?", "car"),
    "code": (("The code for the storage unit is {v}, remind me if I forget.", "Note to self and you: storage unit code {v}.",
              "They changed the storage unit lock, the code is {v} now."), "What is the code of {x}'s storage unit?", "code"),
    "allergy": (("The doctor says I'm allergic to {v}.", "Turns out my rash was an allergy to {v}.",
                 "I have to avoid {v} from now on, allergy test came back positive."), "What is {x} allergic to?", "allergy"),
    "club": (("I joined a {v} club downtown.", "I signed up for the {v} club at the community centre.",
              "Started {v} club on Thursdays, it's so fun."), "What kind of club did {x} join?", "club"),
    "wedding": (("My sister's wedding is on {v}.", "Save the date: my sister gets married on {v}.",
                 "We finally know the wedding date for my sister, {v}."), "When is {x}'s sister's wedding?", "date"),
    "move": (("I'm moving to {v} next month.", "We found a flat in {v}, moving soon.",
              "The relocation is confirmed, I'm off to {v}."), "Which city is {x} moving to?", "city"),
}
CR_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str, str]] = {
    # kind -> (first statements, update statements (with {old}), question, pool)
    "city": (("I live in {v} these days.", "Life in {v} is treating me well."),
             ("Big news: we moved from {old} to {v}!", "I don't live in {old} anymore, I'm in {v} now."),
             "In which city does {x} live now?", "city"),
    "job": (("I work as a {v}.", "Being a {v} keeps me busy."),
            ("I quit being a {old}; I'm a {v} now.", "Career change! No longer a {old}, I work as a {v}."),
            "What is {x}'s current job?", "job"),
    "employer": (("I work at {v}.", "Things at {v} are hectic."),
                 ("I left {old} and joined {v}.", "Switched employers: goodbye {old}, hello {v}."),
                 "Which company does {x} work for now?", "company"),
    "car": (("I drive a {v}.", "My {v} needs new tyres."),
            ("Sold the {old}, I drive a {v} now.", "Replaced the {old} with a {v}."),
            "What vehicle does {x} drive now?", "car"),
    "instrument": (("I play the {v} in a small band.", "Band practice on the {v} tonight."),
                   ("I gave up the {old} and switched to the {v}.", "No more {old} for me, the band needs a {v} player."),
                   "Which instrument does {x} play now?", "instrument"),
    "code": (("The gate code at my building is {v}.", "Gate code is {v}, in case you visit."),
             ("They changed the gate code from {old} to {v}.", "New gate code: {v} (the old {old} stopped working)."),
             "What is the gate code at {x}'s building now?", "code"),
}
MULTI_HOP = {
    # second hop about the related person -> (templates, question)
    "job": (("Remember {p}? {p} just started working as a {v}.", "{p} told me they got hired as a {v}."),
            "What job did {x}'s {rel} get?"),
    "move": (("{p} is moving to {v}, can you believe it?", "Oh, and {p} found a place in {v}."),
             "Which city is {x}'s {rel} moving to?"),
    "pet": (("{p} adopted a {kind} named {v}.", "{p} sent me photos of their new {kind}, {v}."),
            "What is the name of the {kind} that {x}'s {rel} adopted?"),
}
INTRO = ("My {rel} {p} is visiting next week.", "I had lunch with my {rel} {p} yesterday.",
         "My {rel} {p} says hi, by the way.")
ACKS = ("Oh nice, that's great news!", "No way, tell me more!", "That sounds exciting.", "Good for you!",
        "Wow, I didn't see that coming.", "Congrats, honestly.", "Ha, that's so you.", "Noted!",
        "Really? That's a big change.", "I'm happy to hear that.")

# ---------------------------------------------------------------- test-time learning
TTL_DOMAINS = {
    "support tickets": {
        "card": ("I can't find my {item} anywhere, I think it was {how}.", "My {item} was {how}, please block it.",
                 "Someone {how} my {item}, what do I do?"),
        "transfer": ("My transfer to {who} failed {when}.", "The payment to {who} bounced {when}.",
                     "Why was my transfer to {who} rejected {when}?"),
        "pin": ("How do I change the PIN on my {item}?", "I forgot the PIN for my {item}.",
                "Can I reset my {item} PIN online?"),
        "refund": ("I want a refund for the order I returned {when}.", "The shop promised a refund {when} and nothing came.",
                   "Where is my refund from {who}?"),
        "locked": ("My online account got locked {when}.", "I'm locked out of the app since {when}.",
                   "Too many login attempts and now my account is locked, {when}."),
    },
    "news headlines": {
        "sports": ("{team} win the cup after a late goal {when}", "Star striker joins {team} {when}",
                   "{team} coach sacked after third defeat {when}"),
        "science": ("Researchers map the {thing} genome {when}", "New telescope spots a {thing} {when}",
                    "Study links sleep to {thing} growth {when}"),
        "business": ("Shares of {firm} jump after earnings {when}", "{firm} announces merger talks {when}",
                     "{firm} cuts jobs amid slowdown {when}"),
        "weather": ("Storm warning issued for the coast {when}", "Heatwave breaks records {when}",
                    "Heavy snow closes mountain roads {when}"),
    },
    "film reviews": {
        "positive": ("A {adj} triumph, I loved every minute of {film}.", "{film} is {adj} and moving, see it twice.",
                     "Best thing I've watched this year: {film}, simply {adj}."),
        "negative": ("{film} was a {bad} mess, I walked out.", "Two hours of {bad} dialogue, skip {film}.",
                     "I regret paying for {film}, utterly {bad}."),
        "mixed": ("{film} looks {adj} but the plot is {bad}.", "Parts of {film} are {adj}, the ending is {bad}.",
                  "{film}: {adj} acting, {bad} script."),
    },
}
TTL_FILL = {
    "item": ("debit card", "credit card", "travel card", "business card", "virtual card"),
    "how": ("stolen", "lost", "swallowed by an ATM", "taken from my bag", "left in a taxi"),
    "who": ("my landlord", "a friend", "my utility company", "an online shop", "my sister", "the gym"),
    "when": ("this morning", "yesterday", "last night", "on Friday", "twice this week", "again today", "at noon"),
    "team": ("the Harbour Hawks", "Riverside United", "the Northern Bears", "Old Town Rovers", "the Coastal Comets"),
    "thing": ("coral", "comet", "wheat", "octopus", "galaxy", "fungus", "neuron"),
    "firm": ("Acme Foods", "Polar Airlines", "Vertex Mining", "Lumen Retail", "Orbit Telecom"),
    "adj": ("stunning", "heartfelt", "gorgeous", "clever", "luminous", "gripping"),
    "bad": ("clumsy", "tedious", "incoherent", "lifeless", "bloated", "predictable"),
    "film": ("Night Harbour", "The Long Field", "Paper Moons", "Glass River", "Quiet Engines", "Salt and Smoke"),
}
TTL_LINES = ("Next one for the {domain}: \"{x}\" goes under label {label}.", "\"{x}\", I filed that as label {label}.",
             "Okay, this one: \"{x}\". Label {label}.", "Another example, \"{x}\", that's category {label}.")
TTL_ACKS = ("Got it.", "Makes sense.", "Okay, noted.", "Right, that fits.", "Sure.", "Yep, same as the others.")

# ---------------------------------------------------------------- long-range understanding
STORIES = {
    "kitchen renovation": (
        "We hired a contractor named {name} for the kitchen.", "The {stone} countertops arrived cracked, so annoying.",
        "We painted the kitchen walls {color}.", "The new {appliance} finally got installed.",
        "The kitchen inspection passed on {month} {day}.", "We cooked the first dinner in the new kitchen for {name2}."),
    "marathon training": (
        "I signed up for the {city} marathon.", "Ran my first {km} kilometres without stopping today.",
        "I hurt my {body} on a hill run, taking it easy.", "A physio named {name} fixed my {body}.",
        "Bought {shoe} running shoes for race day.", "Finished the marathon in {hours} hours, I'm so proud."),
    "community garden": (
        "Our street started a community garden behind the {place}.", "We planted {plant} along the fence.",
        "Slugs ate half the {plant}, we tried copper tape.", "{name} built raised beds out of {wood}.",
        "The first harvest was mostly {veg}.", "We held a garden party and {name2} brought a {instrument}."),
    "trip planning": (
        "We started planning a trip to {city}.", "We booked a {lodging} near the old town.",
        "Our flight got moved to {month} {day}.", "{name} agreed to water the plants while we're away.",
        "We want to try the {dish} everyone talks about.", "The trip is set, we leave with {name2} in the car."),
}
STORY_FILL = {
    "stone": ("marble", "granite", "quartz", "slate"), "color": ("sage green", "terracotta", "butter yellow", "dusty blue"),
    "appliance": ("induction hob", "dishwasher", "range hood", "double oven"), "km": ("fifteen", "twenty", "twenty-five"),
    "body": ("left knee", "right ankle", "hamstring", "achilles"), "shoe": ("neon orange", "carbon-plated", "minimalist"),
    "hours": ("four", "three and a half", "four and a half"), "place": ("library", "fire station", "old bakery"),
    "plant": ("sunflowers", "runner beans", "lavender", "kale"), "wood": ("pallets", "cedar planks", "railway sleepers"),
    "veg": ("courgettes", "radishes", "beetroot"), "lodging": ("houseboat", "farmhouse", "guesthouse"),
    "dish": ("fish stew", "bean pie", "saffron rice"), "instrument": INSTRUMENTS,
}

# ---------------------------------------------------------------- small talk (no answer-pool words)
SMALL_TALK = (
    "It has been {weather} all week here.", "I made {food} for dinner, nothing fancy.",
    "Have you watched anything good lately? I keep rewatching old sitcoms.", "Traffic this morning was {adjective}.",
    "I need more sleep, honestly.", "The coffee at the office is {adjective} today.",
    "We might go to the {outing} on the weekend if the weather holds.", "My phone battery dies so fast lately.",
    "I cleaned the whole flat yesterday, it took forever.", "Did you see the game last night? What a finish.",
    "I'm trying to drink more water, it's harder than it sounds.", "The {outing} was packed on Sunday.",
    "I tried a new recipe with {food}, it turned out {adjective}.", "My neighbour's kid is learning to whistle. Loudly.",
    "I keep meaning to call my grandmother back.", "Work has been {adjective} lately.",
    "How was your week?", "What are you up to this weekend?", "Anything new with you?",
    "I found an old photo album in a box, so many memories.", "The bus was late again.",
    "It's {weather} out, so I stayed in and read the news.", "I'm thinking of getting a plant for the balcony.",
    "I had {food} at a street stall, it was {adjective}.", "I should really fix my bike this week.",
)
SMALL_REPLIES = (
    "Ha, same here.", "Oh I know the feeling.", "That sounds {adjective}.", "Haha, classic.", "Fair enough.",
    "Not much, just the usual.", "Totally.", "Oh really? Good to know.", "I hear you.", "Honestly, same.",
    "Sounds like a plan.", "Ugh, don't get me started.",
)
SMALL_FILL = {
    "weather": ("rainy", "windy", "grey", "sunny", "foggy", "freezing", "humid"),
    "food": ("soup", "pasta", "tacos", "curry", "omelettes", "dumplings", "risotto", "lentils"),
    "adjective": ("awful", "great", "weird", "fine", "chaotic", "lovely", "so-so", "surprisingly good"),
    "outing": ("park", "beach", "museum", "farmers market", "lake", "flea market"),
}
GREETINGS = ("Hey {o}! Long time no talk.", "Hi {o}, how are you?", "Morning {o}!", "{o}! Got a minute?",
             "Hey, it's been a while, {o}.")


def _fill(template: str, rng: random.Random, pools: dict[str, tuple[str, ...]], **fixed: str) -> str:
    keys = {k: rng.choice(v) for k, v in pools.items() if "{" + k + "}" in template}
    return template.format(**keys, **fixed)


@dataclass
class _Event:
    """A fact-bearing exchange: the turns (speaker index, text) and a tag linking it to questions."""

    lines: list[tuple[int, str]]
    tag: str
    turn_ids: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    events: list[_Event]
    questions: list[tuple[Question, list[str]]]  # question, tags of its evidence events


class _Values:
    """Draws distinct values from the answer pools within one instance."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def draw(self, pool: str) -> str:
        for _ in range(200):
            value = self._one(pool)
            if value not in self.used:
                self.used.add(value)
                return value
        raise ValueError(f"answer pool {pool!r} exhausted; use fewer facts per instance")

    def _one(self, pool: str) -> str:
        r = self.rng
        if pool == "pet":
            return r.choice(PET_NAMES)
        if pool == "job":
            return r.choice(JOBS)
        if pool == "company":
            return r.choice(COMPANIES)
        if pool == "instrument":
            return r.choice(INSTRUMENTS)
        if pool == "book":
            return f"The {r.choice(BOOK_ADJ)} {r.choice(BOOK_NOUN)}"
        if pool == "car":
            return f"{r.choice(CAR_COLORS)} {r.choice(CARS)}"
        if pool == "code":
            return str(r.randint(1000, 9999))
        if pool == "allergy":
            return r.choice(ALLERGIES)
        if pool == "club":
            return r.choice(CLUBS)
        if pool == "date":
            return f"{r.randint(1, 28)} {r.choice(MONTHS)}"
        if pool == "city":
            return r.choice(CITIES)
        if pool == "name":
            return r.choice(NAMES)
        raise KeyError(pool)


def _ack(rng: random.Random, speaker: int) -> tuple[int, str]:
    return (1 - speaker, rng.choice(ACKS))


def _plan_accurate_retrieval(rng, names, values, n_facts) -> _Plan:
    events, questions = [], []
    n_multi = n_facts // 3
    subjects = [(s, k) for s in (0, 1) for k in AR_KINDS]
    rng.shuffle(subjects)
    if n_facts - n_multi > len(subjects) or n_multi > len(RELATIONS):
        raise ValueError(f"facts_per_instance={n_facts} is too many for accurate_retrieval (needs {n_facts - n_multi} "
                         f"single-hop facts of {len(subjects)} and {n_multi} multi-hop facts of {len(RELATIONS)})")
    for q_index in range(n_facts - n_multi):
        speaker, kind = subjects[q_index]
        templates, question, pool = AR_KINDS[kind]
        pet_kind = rng.choice(PET_KINDS)
        value = values.draw(pool)
        text = rng.choice(templates).format(v=value, kind=pet_kind)
        events.append(_Event([(speaker, text), _ack(rng, speaker)], f"f{q_index}"))
        q = Question(f"q{len(questions)}", question.format(x=names[speaker], kind=pet_kind), [value], "single_hop")
        questions.append((q, [f"f{q_index}"]))
    relations = rng.sample(RELATIONS, k=n_multi)
    for m, rel in enumerate(relations):
        speaker = rng.randint(0, 1)
        person = values.draw("name")
        kind = rng.choice(sorted(MULTI_HOP))
        templates, question = MULTI_HOP[kind]
        pet_kind = rng.choice(PET_KINDS)
        value = values.draw({"job": "job", "move": "city", "pet": "pet"}[kind])
        intro = _Event([(speaker, rng.choice(INTRO).format(rel=rel, p=person)), _ack(rng, speaker)], f"m{m}a")
        hop = _Event([(speaker, rng.choice(templates).format(p=person, v=value, kind=pet_kind)), _ack(rng, speaker)], f"m{m}b")
        events += [intro, hop]
        q = Question(f"q{len(questions)}", question.format(x=names[speaker], rel=rel, kind=pet_kind), [value], "multi_hop")
        questions.append((q, [f"m{m}a", f"m{m}b"]))
    rng.shuffle(events)
    # the introduction of a person comes before the fact about them
    for m in range(len(relations)):
        a = next(i for i, e in enumerate(events) if e.tag == f"m{m}a")
        b = next(i for i, e in enumerate(events) if e.tag == f"m{m}b")
        if a > b:
            events[a], events[b] = events[b], events[a]
    return _Plan(events, questions)


def _plan_conflict_resolution(rng, names, values, n_facts, max_updates) -> _Plan:
    subjects = [(s, k) for s in (0, 1) for k in CR_KINDS]
    if n_facts > len(subjects):
        raise ValueError(f"facts_per_instance={n_facts} is too many for conflict_resolution (at most {len(subjects)})")
    rng.shuffle(subjects)
    rounds: list[list[_Event]] = [[] for _ in range(max_updates + 1)]
    questions = []
    for f in range(n_facts):
        speaker, kind = subjects[f]
        first, updates, question, pool = CR_KINDS[kind]
        history = [values.draw(pool) for _ in range(1 + rng.randint(1, max_updates))]
        rounds[0].append(_Event([(speaker, rng.choice(first).format(v=history[0])), _ack(rng, speaker)], f"c{f}.0"))
        for u in range(1, len(history)):
            text = rng.choice(updates).format(v=history[u], old=history[u - 1])
            rounds[u].append(_Event([(speaker, text), _ack(rng, speaker)], f"c{f}.{u}"))
        q = Question(f"q{f}", question.format(x=names[speaker]), [history[-1]], "conflict",
                     superseded_answers=history[:-1])
        questions.append((q, [f"c{f}.{len(history) - 1}"]))
    events = []
    for group in rounds:  # every value is stated before any of its updates
        rng.shuffle(group)
        events += group
    return _Plan(events, questions)


def _plan_test_time_learning(rng, names, values, n_facts) -> _Plan:
    domain = rng.choice(sorted(TTL_DOMAINS))
    classes = sorted(TTL_DOMAINS[domain])
    labels = dict(zip(classes, rng.sample(range(len(classes)), len(classes))))
    per_class = max(2, math.ceil(2 * n_facts / len(classes)))
    seen: set[str] = set()

    def sample(cls: str) -> str:
        for _ in range(100):
            text = _fill(rng.choice(TTL_DOMAINS[domain][cls]), rng, TTL_FILL)
            if text not in seen:
                seen.add(text)
                return text
        raise ValueError(f"test-time learning class {cls!r} has too few distinct inputs for {n_facts} questions")

    examples = [(cls, sample(cls)) for cls in classes for _ in range(per_class)]
    rng.shuffle(examples)
    speaker = rng.randint(0, 1)
    events = [_Event([(speaker, rng.choice(TTL_LINES).format(domain=domain, x=text, label=labels[cls])),
                      (1 - speaker, rng.choice(TTL_ACKS))], f"x.{cls}") for cls, text in examples]
    intro = _Event([(speaker, f"I'm sorting {domain} at work into numbered labels, can I think out loud with you?"),
                    (1 - speaker, "Sure, go ahead.")], "intro")
    questions = []
    for i in range(n_facts):
        cls = classes[i % len(classes)]
        q = Question(f"q{i}", f"Using the numbered labels {names[speaker]} used for {domain}, which label fits "
                     f"\"{sample(cls)}\"? Answer as \\boxed{{label}}.", [str(labels[cls])], "classification")
        questions.append((q, [f"x.{cls}"]))
    return _Plan([intro] + events, questions)


def _plan_long_range(rng, names, values, n_facts) -> _Plan:
    n_stories = max(1, min(len(STORIES), n_facts // 5))
    stories = rng.sample(sorted(STORIES), n_stories)
    per_story = max(2, min(6, math.ceil(n_facts / n_stories)))
    streams, questions = [], []
    for s, story in enumerate(stories):
        speaker = rng.randint(0, 1)
        keywords, stream = [], []
        story_fill = {k: rng.choice(v) for k, v in STORY_FILL.items()}  # one value per slot: a consistent story
        for template in STORIES[story][:per_story]:
            fixed = {}
            for slot in ("name", "name2"):
                if "{" + slot + "}" in template:
                    fixed[slot] = values.draw("name")
            if "{city}" in template:
                fixed["city"] = values.draw("city")
            if "{month}" in template:
                fixed["month"], fixed["day"] = rng.choice(MONTHS), str(rng.randint(1, 28))
            fill = {k: v for k, v in story_fill.items() if "{" + k + "}" in template}
            text = template.format(**fill, **fixed)
            keywords += [v for k, v in {**fill, **fixed}.items() if k != "day"]
            stream.append(_Event([(speaker, text), _ack(rng, speaker)], f"s{s}"))
        streams.append(stream)
        q = Question(f"q{s}", f"Summarize how {names[speaker]}'s {story} went across your conversations.",
                     list(dict.fromkeys(keywords)), "summary")
        questions.append((q, [f"s{s}"]))
    events = []
    while any(streams):  # interleave stories, each in its own order
        stream = rng.choice([st for st in streams if st])
        events.append(stream.pop(0))
    return _Plan(events, questions)


def _session_date(day: dt.date, rng: random.Random) -> str:
    hour, minute = rng.randint(8, 21), rng.choice((0, 15, 30, 45))
    return f"{(hour - 1) % 12 + 1}:{minute:02d} {'am' if hour < 12 else 'pm'} on {day.day} {MONTHS[day.month - 1]}, {day.year}"


def _instance_rng(seed: int, index: int) -> random.Random:
    digest = hashlib.sha256(f"{GENERATOR}:{seed}:{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def generate_instance(cfg: SynthConfig, index: int, counter: TokenCounts) -> Instance:
    """The index-th instance of the set described by cfg (independent of the other instances)."""
    rng = _instance_rng(cfg.seed, index)
    competency = cfg.competencies[index % len(cfg.competencies)]
    n_chunks = cfg.chunks_per_instance[(index // len(cfg.competencies)) % len(cfg.chunks_per_instance)]
    names = rng.sample(NAMES, 2)
    values = _Values(rng)
    values.used.update(names)
    planner = {
        "accurate_retrieval": lambda: _plan_accurate_retrieval(rng, names, values, cfg.facts_per_instance),
        "conflict_resolution": lambda: _plan_conflict_resolution(rng, names, values, cfg.facts_per_instance, cfg.updates_per_fact),
        "test_time_learning": lambda: _plan_test_time_learning(rng, names, values, cfg.facts_per_instance),
        "long_range_understanding": lambda: _plan_long_range(rng, names, values, cfg.facts_per_instance),
    }[competency]
    plan = planner()

    n_distractor = min(round(cfg.distractor_share * n_chunks), n_chunks - 1)
    distractor = set(rng.sample(range(n_chunks), n_distractor))
    fact_slots = [s for s in range(n_chunks) if s not in distractor]
    slot_events: list[list[_Event]] = [[] for _ in range(n_chunks)]
    for j, event in enumerate(plan.events):  # in order, spread evenly over the fact slots
        slot_events[fact_slots[j * len(fact_slots) // len(plan.events)]].append(event)

    day = dt.date(2022, 1, 1) + dt.timedelta(days=rng.randint(0, 700))
    date = _session_date(day, rng)
    header_cost = counter.count(DIALOGUE_HEADER.format(date=date))
    budget = int((cfg.chunk_tokens - header_cost) * 0.97) - 2
    turns: list[Turn] = []
    costs: dict[str, int] = {}

    def cost_of(speaker: int, text: str) -> int:
        # small-talk lines repeat a lot: count each distinct line once
        line = f"{names[speaker]}: {text}\n"
        if line not in costs:
            costs[line] = counter.count(line)
        return costs[line]

    def emit(speaker: int, text: str, new_chunk: bool = False) -> int:
        turn = Turn(text, names[speaker], date, f"t{len(turns)}", new_chunk)
        turns.append(turn)
        return cost_of(speaker, text)

    for slot in range(n_chunks):
        if slot == 0 or rng.random() < 0.5:
            day += dt.timedelta(days=rng.randint(1, 12))
            date = _session_date(day, rng)
            speaker = rng.randint(0, 1)
            used = emit(speaker, rng.choice(GREETINGS).format(o=names[1 - speaker]), new_chunk=True)
        else:
            used = emit(rng.randint(0, 1), _fill(rng.choice(SMALL_TALK), rng, SMALL_FILL), new_chunk=True)
        events = slot_events[slot]
        fact_cost = sum(cost_of(s, t) for e in events for s, t in e.lines)
        filler: list[tuple[int, str]] = []
        while True:
            speaker = rng.randint(0, 1)
            pair = [(speaker, _fill(rng.choice(SMALL_TALK), rng, SMALL_FILL)),
                    (1 - speaker, _fill(rng.choice(SMALL_REPLIES), rng, SMALL_FILL))]
            cost = sum(cost_of(s, t) for s, t in pair)
            if used + fact_cost + cost > budget:
                break
            filler.append(pair)
            used += cost
        cuts = sorted(rng.randint(0, len(filler)) for _ in events)
        position = 0
        for event, cut in zip(events, cuts):
            for pair in filler[position:cut]:
                for s, t in pair:
                    emit(s, t)
            position = cut
            for s, t in event.lines:
                event.turn_ids.append(f"t{len(turns)}")
                emit(s, t)
        for pair in filler[position:]:
            for s, t in pair:
                emit(s, t)

    chunked = chunk_turns(turns, counter, cfg.chunk_tokens)
    by_tag: dict[str, list[int]] = {}
    for event in plan.events:
        by_tag.setdefault(event.tag, []).extend(c for tid in event.turn_ids for c in chunked.turn_chunks[tid])
    questions = []
    for question, tags in plan.questions:
        question.evidence_chunks = sorted({c for tag in tags for c in by_tag[tag]})
        questions.append(question)
    metadata: dict[str, Any] = {
        "generator": GENERATOR, "seed": cfg.seed, "index": index, "speakers": names,
        "num_tokens": sum(chunked.token_counts), "chunk_tokens": cfg.chunk_tokens,
        "distractor_chunks": sorted(distractor),
    }
    return Instance(f"synth-{cfg.seed}-{index:05d}", "synthetic", competency, chunked.chunks, questions, metadata)


def generate(cfg: SynthConfig, tokenizer: Any = regex_token_count, progress: bool = False) -> list[Instance]:
    """All instances of the set; deterministic for a given config and tokenizer."""
    from tqdm.auto import tqdm

    counter = tokenizer if isinstance(tokenizer, TokenCounts) else TokenCounts(tokenizer)
    return [generate_instance(cfg, i, counter)
            for i in tqdm(range(cfg.instances), desc="generating", unit="inst", disable=not progress)]


def config_dict(cfg: SynthConfig) -> dict[str, Any]:
    """JSON-friendly knobs (for the manifest)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
