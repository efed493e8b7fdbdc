"""Held-out chat prompts for the serving benchmark: none of them is used by the tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

SERVING_PROMPTS = [
    "What are three good habits for a healthy morning routine?",
    "Explain how a rainbow forms.",
    "Write a short poem about a lighthouse at night.",
    "How many continents are there, and what are they called?",
    "Give me a recipe idea that uses potatoes and spinach.",
    "What is the difference between a virus and a bacterium?",
    "Describe the water cycle in simple terms.",
    "Suggest three names for a friendly robot.",
    "Why do cats purr?",
    "What is a prime number? Give two examples.",
    "Write a two-sentence horror story.",
    "How does a bicycle stay upright while moving?",
    "What should I consider when adopting a dog?",
    "Explain what an API is to someone who has never programmed.",
    "Tell me a fun fact about octopuses.",
    "How do I politely decline a meeting invitation?",
    "What causes the seasons on Earth?",
    "Write a thank-you note to a teacher.",
    "List four ways to save energy at home.",
    "What is the Pythagorean theorem?",
    "Describe the taste of a ripe mango to someone who has never had one.",
    "How do airplanes fly?",
    "Give me a short pep talk before an exam.",
    "What are the main ingredients of a Caesar salad?",
    "Explain the rules of tic-tac-toe.",
    "What is the tallest mountain in the world, and how tall is it?",
    "Write a riddle whose answer is 'a shadow'.",
    "How do vaccines help the immune system?",
    "What are some tips for writing a good essay?",
    "Describe a busy market in the early morning.",
    "Why is recycling important?",
    "Translate 'where is the train station?' into French.",
    "How does compound interest work?",
    "Write a short dialogue between a cat and a dog.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Give three reasons people enjoy gardening.",
    "Explain what a black hole is in two or three sentences.",
    "What is a good way to start learning to play the guitar?",
    "Describe your ideal weekend in a few sentences.",
    "How do bees make honey?",
]


def chat_texts(model: Path, prompts: Sequence[str]) -> list[str]:
    """Each prompt as a user turn in `model`'s chat template, as text for a gRPC request."""
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return [
        str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
        )
        for p in prompts
    ]
