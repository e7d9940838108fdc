"""Stage ``synth``: a deterministic synthetic dataset with planted gold sessions.

Each question asks about one personal fact ("What is the name of my dog?", "Which city did I move
to?"). The fact is planted in 1-2 *gold* sessions that talk about nothing else and repeat the
distinctive words (dog, puppy, the name), so that an off-the-shelf sentence-embedding model
(all-MiniLM-L6-v2) ranks the gold sessions at the top; the rest of the haystack is filler on
unrelated topics (cooking, taxes, Python, ...), some of it drawn from a pool shared by several
questions (exercises de-duplication). Answers are short strings that never occur in filler text.
Every session has one date; a haystack is in chronological order and the question date follows its
last session. All randomness comes from ``random.Random(seed)``: the same config gives the same
tables, byte for byte.
"""

from __future__ import annotations

import datetime as _dt
import logging
import random
from dataclasses import dataclass

from pydantic import Field, model_validator

from ..store import storage
from ..stage import StageConfig, stage
from ..data.model import Dataset, DatasetBuilder, Question

log = logging.getLogger(__name__)


# Turns generated at most (questions × sessions_per_question × turns_per_session): the dataset is built
# in memory (about 0.5 KB a turn), so 2,000,000 turns is about 1 GB, ~10 s on one core; each field's
# own bound alone would allow 4 × 10^11 turns.
MAX_TURNS = 2_000_000


class SynthConfig(StageConfig):
    questions: int = Field(12, ge=1, le=1_000_000, description="number of questions")
    sessions_per_question: int = Field(16, ge=2, le=10_000, description="haystack sessions per question (gold included)")
    seed: int = Field(0, description="random seed (same seed, same dataset)")
    turns_per_session: int = Field(4, ge=2, le=40, description="turns per session (user/assistant alternate)")
    gold_per_question: int = Field(1, ge=1, le=2, description="gold sessions per question (1 or 2)")

    @model_validator(mode="after")
    def _room_for_filler(self) -> "SynthConfig":
        if self.sessions_per_question <= self.gold_per_question:
            raise ValueError("sessions_per_question must be larger than gold_per_question")
        turns = self.questions * self.sessions_per_question * self.turns_per_session
        if turns > MAX_TURNS:
            raise ValueError(f"questions × sessions_per_question × turns_per_session = {self.questions:,} × "
                             f"{self.sessions_per_question:,} × {self.turns_per_session} = {turns:,} turns; at "
                             f"most {MAX_TURNS:,} (the dataset is built in memory: fewer questions or sessions)")
        return self


# --------------------------------------------------------------------------- facts
@dataclass(frozen=True)
class Fact:
    kind: str
    question: str
    answers: tuple[str, ...]
    plant: tuple[str, str]             # (user, assistant) of the first gold session
    follow: tuple[str, ...]            # more on-topic lines for the gold sessions
    update: tuple[str, str]            # (user, assistant) of the second gold session


FACTS: tuple[Fact, ...] = (
    Fact("pet-name", "What is the name of my dog?",
         ("Biscuit", "Pepper", "Waffles", "Noodle", "Mochi", "Ziggy", "Pretzel", "Bramble"),
         ("I adopted a golden retriever puppy last weekend and we named our dog {a}.",
          "Congratulations on adopting {a}! A golden retriever puppy needs patience, chew toys and short walks."),
         ("{a} the puppy keeps chewing my shoes; how do I train my dog to stop?",
          "Redirect {a} to a chew toy every time and praise your dog when the puppy chooses it.",
          "Should I crate train {a} at night? My dog whines a lot.",
          "Crate training helps a puppy like {a} feel safe; put a blanket in the crate."),
         ("Took my dog {a} to the vet today for puppy vaccines.",
          "Glad {a}'s vet visit went well; puppies need boosters every few weeks.")),
    Fact("moved-city", "Which city did I move to?",
         ("Lisbon", "Osaka", "Denver", "Tallinn", "Montreal", "Valencia", "Auckland", "Edinburgh"),
         ("I finally moved to {a} last month and I'm still unpacking boxes in my new apartment.",
          "Welcome to {a}! Moving to a new city takes time; unpack the kitchen first."),
         ("What neighbourhoods in {a} are good for meeting people after a move?",
          "In {a}, join local meetups near your new apartment to settle into the city.",
          "The move to {a} was stressful; the movers lost a box of books.",
          "Relocating is hard; file a claim with the moving company and explore {a} on foot."),
         ("Now that I live in {a}, I need to register my new address in the city.",
          "Registering your address in {a} is usually done at the city hall after a move.")),
    Fact("sister-name", "What is my sister's name?",
         ("Margot", "Priya", "Annika", "Lucia", "Henrietta", "Sunniva", "Oksana", "Beatriz"),
         ("My younger sister {a} is visiting next week and I want to plan fun things for my sister.",
          "How lovely that your sister {a} is visiting! Plan one special outing for you and {a}."),
         ("{a} loves board games; what games would my sister enjoy?",
          "For a sister who loves board games, {a} might enjoy cooperative games.",
          "My sister {a} and I used to share a bedroom as kids.",
          "Siblings who shared a room often stay close; you and {a} sound close."),
         ("My sister {a} just got engaged!", "Congratulations to your sister {a} on the engagement!")),
    Fact("car", "What car did I buy?",
         ("Subaru Outback", "Mazda MX-5", "Volvo XC40", "Kia Niro", "Honda Civic", "Tesla Model 3",
          "Ford Maverick", "Toyota Prius"),
         ("I just bought a {a}! Picking up my new car from the dealership was exciting.",
          "Congrats on the {a}! A new car needs its first service after a few thousand miles."),
         ("What car insurance coverage do I need for my {a}?",
          "For a new car like the {a}, comprehensive coverage is worth it.",
          "How often should I rotate the tyres on the {a}?",
          "Rotate the tyres on your {a} every 5,000 to 7,500 miles."),
         ("My {a} needs its first oil change at the dealership.",
          "The first service of your {a} is a good time to check the car's software too.")),
    Fact("instrument", "Which instrument am I learning to play?",
         ("cello", "banjo", "ukulele", "oboe", "trombone", "harp", "accordion", "clarinet"),
         ("I started taking {a} lessons this month; learning to play the {a} is harder than I expected.",
          "Learning the {a} takes patience; practise your instrument for twenty minutes daily."),
         ("My {a} teacher says my posture is wrong; how should I hold the instrument?",
          "Relax your shoulders and keep the {a} balanced while you play.",
          "What are good beginner pieces for the {a}?",
          "Simple folk tunes and scales are ideal for a beginner {a} player."),
         ("I played the {a} at my music school's recital!", "Performing on the {a} at a recital is a big step!")),
    Fact("allergy", "What am I allergic to?",
         ("peanuts", "shellfish", "penicillin", "sesame", "latex", "bee stings", "mustard", "celery"),
         ("The allergist confirmed I'm allergic to {a}, so I have to be careful now.",
          "An allergy to {a} means reading labels carefully and carrying your prescribed medication."),
         ("How do I tell restaurants about my {a} allergy?",
          "Tell the staff clearly that you have a {a} allergy before ordering.",
          "Do I need an epinephrine pen for a {a} allergy?",
          "Ask your allergist; many people allergic to {a} carry one."),
         ("I had a mild reaction to {a} again at a party.",
          "Sorry about the reaction; avoid {a} and follow your allergist's plan.")),
    Fact("employer", "Which company do I work for now?",
         ("Initech", "Globex", "Acme Robotics", "Umbrella Labs", "Stark Freight", "Wayne Logistics",
          "Hooli", "Vandelay Industries"),
         ("I accepted the job offer and started working at {a} as a data analyst this week.",
          "Congratulations on the new job at {a}! Your first weeks at a company are for learning."),
         ("My manager at {a} wants a report on customer churn; how should I structure it?",
          "For your {a} report, start with the churn rate, then the drivers.",
          "The onboarding at {a} is chaotic; how do I make a good impression at work?",
          "Ask questions early and deliver a small win at {a} within a month."),
         ("Got my first performance review at {a} and it went great.",
          "A strong first review at {a} is a great start in your job.")),
    Fact("book-club", "What book is my book club reading?",
         ("Middlemarch", "Beloved", "Rebecca", "Dune", "Frankenstein", "Persuasion", "Kindred", "Stoner"),
         ("My book club picked {a} for this month, so I'm reading {a} every evening.",
          "{a} is a great book club choice; note the themes you want to discuss."),
         ("What discussion questions could I bring to book club about {a}?",
          "Ask how the characters in {a} change and what the ending means.",
          "I'm halfway through {a} and the book is slow.",
          "Many readers find {a} picks up in the second half of the book."),
         ("Our book club meeting about {a} was lively.", "Great that the {a} discussion went well at book club!")),
    Fact("coffee-order", "What is my usual coffee order?",
         ("oat milk latte", "flat white", "cortado", "iced americano", "cold brew", "cappuccino",
          "macchiato", "mocha"),
         ("Every morning I order my usual {a} from the café near the office.",
          "A daily {a} is a nice ritual; the barista probably knows your coffee order by now."),
         ("Is a {a} every day too much caffeine?",
          "One {a} a day is well within normal caffeine limits for most adults.",
          "Can I make a {a} at home without an espresso machine?",
          "You can approximate a {a} at home with a moka pot."),
         ("The café changed the recipe of my {a} and I don't like it.",
          "Ask the barista to make your {a} the old way.")),
    Fact("new-sport", "What sport did I take up recently?",
         ("bouldering", "fencing", "curling", "archery", "kayaking", "squash", "rowing", "judo"),
         ("I took up {a} recently and joined a local {a} club that meets twice a week.",
          "{a} is a great sport to pick up; a club helps you learn good technique."),
         ("I'm sore after {a} practice; how do I recover faster?",
          "Stretch after {a} sessions and sleep well to recover.",
          "What gear do I need for {a} as a beginner?",
          "Most {a} clubs lend beginner gear before you buy your own."),
         ("I entered my first {a} competition!", "Competing in {a} so soon shows real commitment to the sport!")),
    Fact("anniversary-trip", "Where did I go for my anniversary trip?",
         ("Santorini", "Kyoto", "Banff", "Marrakech", "Reykjavik", "Dubrovnik", "Havana", "Queenstown"),
         ("For our anniversary trip my partner and I flew to {a}, and {a} was breathtaking.",
          "What a romantic anniversary trip! {a} is a beautiful place to celebrate."),
         ("Can you help me make a photo album of our anniversary trip to {a}?",
          "Group the {a} photos by day of the trip and add captions.",
          "We want to return to {a} for our next anniversary.",
          "Returning to {a} could become an anniversary tradition."),
         ("I framed a picture from our anniversary in {a}.",
          "A framed photo from {a} is a lovely anniversary keepsake.")),
    Fact("language", "Which language am I studying?",
         ("Portuguese", "Korean", "Swahili", "Finnish", "Greek", "Turkish", "Polish", "Hebrew"),
         ("I'm studying {a} with an app every day and practising {a} with a tutor on Fridays.",
          "Studying {a} daily is the best way to learn a language; speaking with a tutor helps a lot."),
         ("What's the hardest part of {a} grammar for English speakers?",
          "Learners of {a} often struggle with verb forms; drill them in short sessions.",
          "Can you recommend podcasts for learning {a}?",
          "Slow-paced {a} podcasts for learners are great for listening practice."),
         ("I passed my first {a} language exam!", "Passing a {a} exam is a real milestone in learning the language!")),
)


# --------------------------------------------------------------------------- filler
FILLER_TOPICS: tuple[tuple[tuple[str, ...], tuple[str, ...], dict[str, tuple[str, ...]]], ...] = (
    (("Can you suggest a quick weeknight recipe using {x} and {y}?",
      "How long should I cook {x} so it stays tender?",
      "Could I swap {y} for something else in that recipe?"),
     ("Try a one-pan {d}: saute {x}, add {y}, season and simmer for twenty minutes.",
      "Cook {x} on medium heat and taste it as you go; {y} can go in at the end.",
      "A {d} freezes well, so make a double batch."),
     {"x": ("chickpeas", "spinach", "lentils", "mushrooms", "zucchini", "tofu"),
      "y": ("rice", "potatoes", "carrots", "broccoli", "couscous", "tomatoes"),
      "d": ("stir-fry", "curry", "soup", "frittata", "casserole", "stew")}),
    (("How do I estimate quarterly tax payments as a {x}?",
      "Which expenses can a {x} deduct, like {y}?",
      "What happens if I underpay my estimated taxes?"),
     ("Estimate this year's income, apply last year's effective rate and split it into four payments.",
      "Keep receipts for {y}; many {x} expenses are deductible if they are business related.",
      "Underpayment usually means a small penalty, so pay what you can each quarter."),
     {"x": ("freelancer", "contractor", "consultant", "sole proprietor"),
      "y": ("a home office", "software subscriptions", "mileage", "equipment")}),
    (("My Python script raises a {x} when it reads a {y} file. How do I debug it?",
      "How do I write a unit test for a function that parses {y}?",
      "Should I use a virtual environment for this project?"),
     ("A {x} usually means the data is not shaped the way the code expects; print the offending row.",
      "Use pytest with a small {y} fixture and assert on the parsed result.",
      "Yes, a virtual environment keeps the dependencies of each project separate."),
     {"x": ("KeyError", "ValueError", "UnicodeDecodeError", "TypeError"),
      "y": ("CSV", "JSON", "YAML", "XML")}),
    (("When should I prune my {x} plants?", "My {x} leaves are turning {y}; what does that mean?",
      "How often should I water the garden in summer?"),
     ("Prune {x} in late winter, before new growth, and remove dead stems first.",
      "Leaves turning {y} often point to overwatering or a nutrient problem.",
      "Water deeply twice a week in the early morning rather than a little every day."),
     {"x": ("tomato", "rose", "raspberry", "hydrangea", "blueberry"),
      "y": ("yellow", "brown", "pale", "spotted")}),
    (("Can you make me a {x}-day workout plan focused on {y}?", "How many rest days do I need per week?",
      "Is it fine to do cardio on the same day as strength training?"),
     ("Here is a {x}-day split for {y}: compound lifts first, accessories after, and progressive overload.",
      "One or two rest days a week let muscles recover.",
      "Yes, just do the strength work first so your form stays good."),
     {"x": ("three", "four", "five"), "y": ("legs", "core strength", "upper body", "mobility")}),
    (("How do I fix a leaky {x} at home?", "What tools do I need to replace a {y}?",
      "Should I call a plumber instead?"),
     ("Turn off the water supply, take apart the {x} and replace the worn washer.",
      "An adjustable wrench, plumber's tape and a screwdriver are enough to replace a {y}.",
      "Call a plumber if the leak is behind a wall or the shutoff valve is stuck."),
     {"x": ("faucet", "shower head", "toilet valve", "pipe joint"),
      "y": ("cartridge", "washer", "flapper", "supply hose")}),
    (("Can you explain how {x} works with an example?", "Where is {x} used in practice?",
      "What's a common mistake people make with {x}?"),
     ("{x} is easiest to see with numbers: work a small case by hand, then generalise.",
      "You see {x} in finance, statistics and computer science.",
      "A common mistake with {x} is applying it without checking its assumptions."),
     {"x": ("compound interest", "standard deviation", "binary search", "Bayes' theorem", "linear regression")}),
    (("Can you help me write a polite email to reschedule a {x} meeting?",
      "How do I decline a {x} meeting without sounding rude?", "Should I propose new times in the email?"),
     ("Thank them, explain briefly that you need to move the {x} meeting, and offer two alternatives.",
      "Say you cannot attend this {x} meeting and ask for the notes afterwards.",
      "Yes, proposing two or three slots makes rescheduling faster."),
     {"x": ("project kickoff", "budget review", "one-on-one", "quarterly planning")}),
    (("What were the main causes of the {x}?", "Which books would you recommend about the {x}?",
      "How did the {x} change everyday life?"),
     ("Historians point to economic pressure, new ideas and political conflict as causes of the {x}.",
      "Start with a general survey of the {x}, then a biography of a key figure.",
      "The {x} changed work, family life and how people saw authority."),
     {"x": ("Industrial Revolution", "Renaissance", "printing revolution", "Enlightenment")}),
    (("Any tips for falling asleep faster when I'm {x}?", "Is it bad to look at my phone before bed?",
      "How much sleep do adults really need?"),
     ("When you're {x}, keep a regular bedtime, dim the lights and try slow breathing.",
      "Screens before bed can delay sleep; stop scrolling thirty minutes earlier.",
      "Most adults need seven to nine hours of sleep."),
     {"x": ("stressed", "jet-lagged", "restless", "overthinking")}),
    (("Help me build a monthly budget with {x} for groceries.", "How much should I put into savings each month?",
      "What's a good app to track spending?"),
     ("Start from income, subtract fixed costs, set {x} for groceries and split the rest between savings and fun.",
      "A common rule is to save twenty percent of take-home pay.",
      "A simple spreadsheet works as well as an app if you update it weekly."),
     {"x": ("$300", "$450", "$600", "$250")}),
    (("Can you recommend some {x} movies from the {y}?", "What makes a good {x} movie?",
      "Should I watch them in any particular order?"),
     ("Here are some well-loved {x} films from the {y}; pick one with a short runtime for a weeknight.",
      "A good {x} movie has a clear premise and a memorable final act.",
      "Order doesn't matter much unless they're sequels."),
     {"x": ("science fiction", "mystery", "comedy", "animated"), "y": ("1980s", "1990s", "2000s", "1970s")}),
)


def _fmt(template: str, slots: dict[str, str]) -> str:
    return template.format(**slots)


def _filler_turns(rng: random.Random, n_turns: int) -> list[dict]:
    users, assistants, vocab = FILLER_TOPICS[rng.randrange(len(FILLER_TOPICS))]
    slots = {k: rng.choice(v) for k, v in vocab.items()}
    turns = []
    for i in range(n_turns):
        if i % 2 == 0:
            turns.append({"role": "user", "content": _fmt(users[(i // 2) % len(users)], slots)})
        else:
            turns.append({"role": "assistant", "content": _fmt(assistants[(i // 2) % len(assistants)], slots)})
    return turns


def _gold_turns(fact: Fact, answer: str, n_turns: int, second: bool) -> list[dict]:
    first = fact.update if second else fact.plant
    lines = [first[0], first[1]] + list(fact.follow)
    turns = []
    for i in range(n_turns):
        role = "user" if i % 2 == 0 else "assistant"
        turns.append({"role": role, "content": lines[i % len(lines)].format(a=answer)})
    return turns


def _date(base: _dt.datetime, minutes: int) -> tuple[_dt.datetime, str]:
    d = base + _dt.timedelta(minutes=minutes)
    return d, d.strftime("%Y/%m/%d (%a) %H:%M")


# --------------------------------------------------------------------------- generator
def generate(config: SynthConfig) -> Dataset:
    """The dataset for a config (pure function of the config; no I/O)."""
    rng = random.Random(config.seed)
    base = _dt.datetime(2023, 1, 2, 8, 0)
    span = 365 * 24 * 60
    b = DatasetBuilder(f"synth(seed={config.seed})")
    used_ids: set[str] = set()
    when: dict[str, _dt.datetime] = {}
    label: dict[str, str] = {}

    def new_session(turns: list[dict]) -> str:
        while True:
            sid = f"synth_{rng.getrandbits(40):010x}"
            if sid not in used_ids:
                break
        used_ids.add(sid)
        d, text = _date(base, rng.randrange(span))
        when[sid], label[sid] = d, text
        b.add_session(sid, turns, text, item=f"session '{sid}'")
        return sid

    n_fill = config.sessions_per_question - config.gold_per_question
    per_q_shared = max(1, n_fill // 4)
    pool = [new_session(_filler_turns(rng, config.turns_per_session))
            for _ in range(max(2, config.sessions_per_question // 2))]
    per_q_shared = min(per_q_shared, len(pool), n_fill)
    for qi in range(config.questions):
        fact = FACTS[rng.randrange(len(FACTS))]
        answer = rng.choice(fact.answers)
        gold = [new_session(_gold_turns(fact, answer, config.turns_per_session, second=g > 0))
                for g in range(config.gold_per_question)]
        if len(gold) == 2 and when[gold[1]] < when[gold[0]]:  # the update comes after the plant
            when[gold[0]], when[gold[1]] = when[gold[1]], when[gold[0]]
            label[gold[0]], label[gold[1]] = label[gold[1]], label[gold[0]]
            for g in gold:
                b.sessions[g].date = label[g]
        shared = rng.sample(pool, per_q_shared)
        fillers = [new_session(_filler_turns(rng, config.turns_per_session)) for _ in range(n_fill - per_q_shared)]
        hay = sorted(gold + shared + fillers, key=lambda s: (when[s], s))
        last = when[hay[-1]]
        _, qdate = _date(last, rng.randrange(60, 14 * 24 * 60))
        b.add_question(Question(
            question_id=f"synth_q{qi:04d}", dataset="synth", question=fact.question, answer=answer,
            haystack_session_ids=hay, gold_session_ids=[s for s in hay if s in gold], question_date=qdate,
            question_type=fact.kind, haystack_dates=[label[s] for s in hay],
            extra={"fact": fact.kind, "planted_in": len(gold)}))
    return b.build()


@stage("synth", SynthConfig, family="chat",
       help="Deterministic synthetic dataset with planted gold sessions (for tests and the demo)")
def run(config: SynthConfig, out: storage.Publication) -> dict:
    ds = generate(config)
    stats = ds.write(out)
    refs = {}
    for q in ds.questions:
        for s in q.haystack_session_ids:
            refs[s] = refs.get(s, 0) + 1
    stats["shared_sessions"] = sum(1 for n in refs.values() if n > 1)
    stats["seed"] = config.seed
    log.info("synth: %d questions, %d sessions (%d shared by several questions), %d gold", stats["questions"],
             stats["sessions"], stats["shared_sessions"], stats["gold_sessions"])
    return stats
