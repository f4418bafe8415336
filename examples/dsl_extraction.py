"""JSON extraction into a pydantic model: the schema constrains the output, and the variable
holds the validated instance.

python examples/dsl_extraction.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from dsl_common import backend_from_args, close
from pydantic import BaseModel, Field

import weft


class Role(str, Enum):
    engineer = "engineer"
    designer = "designer"
    manager = "manager"


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    role: Role
    address: Address
    skills: list[str]
    email: str | None = None


TEXTS = [
    "Alice Martin, 34, is a software engineer in Lyon, France. She writes Rust and Go. "
    "Reach her at alice@example.com.",
    "Bob Okafor (51) is a project manager in Lagos, Nigeria; he is good at budgeting and hiring.",
]


@weft.function
def extract(s, text: str):
    s += weft.system(
        "Extract the person in the user's text as JSON with the keys of this schema:\n"
        + json.dumps(Person.model_json_schema())
    )
    s += weft.user(text)
    s += weft.assistant(weft.gen("person", json_schema=Person, max_tokens=160))


def main(backend: Any) -> list[Person]:
    states = extract.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0)
    people = []
    for text, s in zip(TEXTS, states, strict=True):
        person = s["person"]  # a Person, validated
        print(f"{text}\n  -> {person!r}")
        people.append(person)
    return people


if __name__ == "__main__":
    backend, args = backend_from_args(__doc__ or "")
    try:
        main(backend)
    finally:
        close(backend)
