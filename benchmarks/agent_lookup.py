"""The `lookup` workload of benchmarks/agent.py: a search tool over a small built-in corpus whose passages the model
copies, several calls per trajectory at spread-out points (Search-R1's shape at a 135M model's scale).

A question names one to three cities ("Which of Oslo, Lima and Cairo has the most people?"); two few-shot exchanges
show the model looking each city up (`<lookup>Oslo</lookup>`), copying the passage it gets back into its notes,
then answering after `####`. So a trajectory makes one to three calls, its turns are long (the copied passages:
where drafts from the context can pay) and trajectories reach their calls at different times (where overlap can).
The tool sleeps `SLEEP_S` seconds first (standing for a search API)."""

from __future__ import annotations

import random
import time
import zlib

SLEEP_S = 0.5
JITTER = False  # latencies drawn per call (tool_latency) instead of SLEEP_S each


def tool_latency(key: str) -> float:
    """SLEEP_S, or with JITTER an exponential draw of mean SLEEP_S seeded by the call's argument: search APIs' and
    sandboxes' latencies are heavy-tailed, and a call made in both loops of a comparison sleeps the same in each."""
    if not JITTER:
        return SLEEP_S
    return random.Random(zlib.crc32(key.strip().encode())).expovariate(1 / SLEEP_S)

CORPUS = {
    "Oslo": "Oslo is the capital of Norway. It lies at the head of the Oslofjord and has about 0.7 million people.",
    "Lima": "Lima is the capital of Peru. It lies on the Pacific coast and has about 10.9 million people.",
    "Cairo": "Cairo is the capital of Egypt. It lies on the Nile river and has about 10 million people.",
    "Paris": "Paris is the capital of France. It lies on the Seine river and has about 2.1 million people.",
    "Rome": "Rome is the capital of Italy. It lies on the Tiber river and has about 2.8 million people.",
    "Tokyo": "Tokyo is the capital of Japan. It lies on Tokyo Bay and has about 14 million people.",
    "Nairobi": "Nairobi is the capital of Kenya. It lies on a high plateau and has about 4.4 million people.",
    "Hanoi": "Hanoi is the capital of Vietnam. It lies on the Red river and has about 8 million people.",
    "Quito": "Quito is the capital of Ecuador. It lies high in the Andes and has about 2 million people.",
    "Dublin": "Dublin is the capital of Ireland. It lies on the Liffey river and has about 1.2 million people.",
    "Madrid": "Madrid is the capital of Spain. It lies on the Manzanares river and has about 3.3 million people.",
    "Seoul": "Seoul is the capital of South Korea. It lies on the Han river and has about 9.6 million people.",
    "Berlin": "Berlin is the capital of Germany. It lies on the Spree river and has about 3.7 million people.",
    "Ottawa": "Ottawa is the capital of Canada. It lies on the Ottawa river and has about 1 million people.",
}
SHOT_CITIES = (("Paris", "Rome"), ("Dublin", "Madrid", "Berlin"))
SYSTEM = ("You can search an encyclopedia: write <lookup>name</lookup> and you will get <result>passage</result>. "
          "Look up one name per turn, copy the passage into your notes, then write the final answer after ####.")


def lookup(query: str) -> str:
    """Search the encyclopedia for a city (after a delay: a benchmark's stand-in for a search API).

    Args:
        query: The name of a city, e.g. "Oslo".
    """
    time.sleep(tool_latency(query))
    q = query.strip().lower()
    for name, text in CORPUS.items():
        if name.lower() == q or name.lower() in q:
            return text
    return f"No entry for {query.strip()!r}."


def question(cities) -> str:
    if len(cities) == 1:
        return f"How many people live in {cities[0]}?"
    names = ", ".join(cities[:-1]) + f" and {cities[-1]}" if len(cities) > 2 else " or ".join(cities)
    return f"Which of {names} has the most people?" if len(cities) > 2 else f"Which city has more people, {names}?"


def people(city: str) -> float:
    return float(CORPUS[city].split("about ")[1].split(" million")[0])


def answer(cities) -> str:
    return f"about {people(cities[0]):g} million" if len(cities) == 1 else max(cities, key=people)


def prefix() -> list[dict]:
    """A system line and two worked exchanges (two and three lookups), each passage copied after `Notes:`."""
    out = [{"role": "system", "content": SYSTEM}]
    for cities in SHOT_CITIES:
        out.append({"role": "user", "content": question(cities)})
        for i, c in enumerate(cities):
            note = f"Notes: {CORPUS[cities[i - 1]]}\n" if i else ""
            out += [{"role": "assistant", "content": f"{note}<lookup>{c}</lookup>"},
                    {"role": "user", "content": f"<result>{CORPUS[c]}</result>"}]
        out.append({"role": "assistant", "content": f"Notes: {CORPUS[cities[-1]]}\n#### {answer(cities)}"})
    return out


def rows(n: int, seed: int = 7) -> list[dict]:
    """n questions on one to three cities (none of the few-shot cities), the number of lookups drawn per row."""
    rng = random.Random(seed)
    shot = {c for cs in SHOT_CITIES for c in cs}
    pool = [c for c in CORPUS if c not in shot]
    out = []
    for _ in range(n):
        cities = rng.sample(pool, rng.choice([1, 2, 3]))
        out.append({"prompt": prefix() + [{"role": "user", "content": question(cities)}], "answer": answer(cities),
                    "task": "lookup", "cities": cities})
    return out
