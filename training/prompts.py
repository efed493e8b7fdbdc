"""Built-in chat instructions for training and evaluating speculators, the chat prompts of the
tests and benchmarks, the chat-template wrapping every user of these prompts shares, and
prompt/text file readers.

`builtin_prompts()` is a fixed, deterministic list: the first `NUM_EVAL_PROMPTS` entries are the
held-out evaluation prompts, the rest are training prompts. Each family of prompts (topic
questions, how-to tasks, comparisons, writing, coding, arithmetic, rewriting, definitions,
translation, advice) draws its fillers from a list whose first entries are reserved for
evaluation: no training prompt mentions an evaluation topic, task, pair or sentence, so the held-out
set measures generalisation to new subjects, not recall of seen prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NUM_EVAL_PROMPTS = 48

# Chat prompts of the tests (greedy output against transformers) and of the decode and verify
# benchmarks; none of them is a built-in training or evaluation prompt.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a ten-year-old.",
    "List three tips for staying focused while studying.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 17 times 23?",
    "Write a Python function that reverses a string.",
    "Give me a short motivational quote.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the health benefits of drinking water?",
    "Describe a sunset over the ocean.",
    "How do I make a cup of tea?",
    "Name five animals that live in the Arctic.",
    "What is the difference between weather and climate?",
    "Write a limerick about a cat who loves cheese.",
    "Hi!",
    "Can you explain what a neural network is, how it is trained with gradient descent, and "
    "why deep networks became practical only in the last two decades? Please mention data, "
    "hardware and algorithmic improvements, and keep the answer suitable for a newcomer who "
    "knows some high-school mathematics but no programming at all.",
    "Suggest a name for a bakery that specialises in sourdough bread.",
    "What should I pack for a weekend hiking trip in the mountains during early spring, "
    "given that the weather can change quickly?",
]


def _user_turn(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt as a user turn under the tokenizer's chat template (the plain
    encoding when it has none), ready for generation."""
    out = []
    for prompt in prompts:
        if tokenizer.chat_template:
            ids: Any = tokenizer.apply_chat_template(
                _user_turn(prompt), add_generation_prompt=True, return_dict=False
            )
            if not isinstance(ids, list):  # a BatchEncoding, should return_dict be ignored
                ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt)["input_ids"]
        out.append([int(t) for t in ids])
    return out


def chat_texts(tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[str]:
    """Each prompt as a user turn under the tokenizer's chat template, as text (e.g. for a gRPC
    request; the prompt itself when the tokenizer has no template)."""
    if not tokenizer.chat_template:
        return list(prompts)
    return [
        str(
            tokenizer.apply_chat_template(_user_turn(p), add_generation_prompt=True, tokenize=False)
        )
        for p in prompts
    ]


_TOPIC_TEMPLATES = (
    "Explain {} in simple terms.",
    "Write a short poem about {}.",
    "Give me three interesting facts about {}.",
    "What are the pros and cons of {}?",
    "Write a short story that involves {}.",
    "How would you describe {} to a ten-year-old?",
    "Summarize the history of {} in one paragraph.",
    "List five questions a curious student might ask about {}.",
    "Write a haiku about {}.",
    "What are common misconceptions about {}?",
    "Why is {} important?",
    "Write a tweet about {}.",
    "Give a two-minute speech about {}.",
    "Give me a beginner's guide to {}.",
    "Write a limerick about {}.",
    "Create a three-question quiz about {}, with answers.",
    "How has {} changed over the last hundred years?",
    "Describe {} in five sentences.",
    "What would a scientist find fascinating about {}?",
    "Write a diary entry from someone who just learned about {}.",
    "Tell me something surprising about {}.",
    "Write an encyclopedia-style introduction to {}.",
    "What are the main ideas someone should know about {}?",
    "Write a dialogue between two friends talking about {}.",
    "Make a list of ten words related to {}.",
    "What careers are connected to {}?",
    "Write a short blog post about {}.",
    "Explain {} using an analogy.",
    "What are the biggest challenges related to {} today?",
    "Write a children's rhyme about {}.",
)

_TOPICS = (
    # reserved for evaluation
    "glaciers",
    "the printing press",
    "origami",
    "submarines",
    "the human heart",
    "tea ceremonies",
    "wind turbines",
    "penguins",
    # training
    "the ocean",
    "volcanoes",
    "snowflakes",
    "chess",
    "bread baking",
    "the moon",
    "jazz music",
    "the Eiffel Tower",
    "electric cars",
    "the Roman Empire",
    "photosynthesis",
    "friendship",
    "time management",
    "sleep",
    "coffee",
    "rainforests",
    "kangaroos",
    "the internet",
    "dinosaurs",
    "the Olympic Games",
    "solar energy",
    "ancient Egypt",
    "climate change",
    "video games",
    "libraries",
    "maps",
    "hot air balloons",
    "earthquakes",
    "mountain climbing",
    "classical music",
    "coral reefs",
    "the French Revolution",
    "artificial intelligence",
    "bridges",
    "spices",
    "elephants",
    "democracy",
    "pizza",
    "the stock market",
    "robots",
    "the Great Wall of China",
    "yoga",
    "tornadoes",
    "the solar system",
    "the Nile",
    "public transportation",
    "board games",
    "deserts",
    "the Renaissance",
    "clocks",
    "meditation",
    "the periodic table",
    "social media",
    "trains",
    "butterflies",
    "photography",
    "the Amazon River",
    "chocolate",
    "space exploration",
    "the Moon landing",
    "wolves",
    "electricity",
    "knitting",
    "the Industrial Revolution",
    "cloud computing",
    "whales",
    "the human brain",
    "hiking",
    "cheese making",
    "the Silk Road",
    "renewable energy",
    "kindness",
    "the Vikings",
    "owls",
    "mathematics",
    "music festivals",
    "fireflies",
    "the Sahara",
    "smartphones",
    "sharks",
    "architecture",
    "the Arctic",
    "rivers",
    "cryptography",
    "pirates",
    "sunflowers",
    "the telescope",
    "street food",
    "marathons",
    "castles",
    "fungi",
    "paper",
    "comets",
    "the violin",
    "ants",
    "recycling plastic bottles",
    "forests",
    "the theory of evolution",
    "rain",
    "museums",
    "sushi",
    "camping",
    "poetry",
)

_HOW_TO_TASKS = (
    # reserved for evaluation
    "repot a houseplant",
    "write a cover letter",
    "clean a cast iron pan",
    "prepare for a job interview",
    # training
    "bake sourdough bread",
    "change a flat bicycle tire",
    "start a vegetable garden",
    "learn a new language",
    "make a budget",
    "improve my handwriting",
    "brew a good cup of coffee",
    "train a puppy to sit",
    "fall asleep faster",
    "organize a small closet",
    "save money on groceries",
    "prepare for a marathon",
    "make friends in a new city",
    "write a short report",
    "plant a tree",
    "remove a coffee stain",
    "tie a tie",
    "start journaling",
    "cook rice on the stove",
    "plan a birthday party",
    "build a birdhouse",
    "study for an exam",
    "reduce stress at work",
    "take better photos with a phone",
    "learn to juggle",
    "make homemade pasta",
    "back up my computer",
    "give a good presentation",
    "choose a good book",
    "paint a room",
    "keep a plant alive",
    "make a paper airplane",
    "start running",
    "write a postcard",
    "set up a fish tank",
    "learn to swim",
)

_HOW_TO_TEMPLATES = (
    "How do I {}?",
    "Give me step-by-step instructions to {}.",
    "What is the easiest way to {}?",
    "I want to {}. Where should I start?",
    "What mistakes should I avoid when I {}?",
    "Explain to a beginner how to {}.",
)

_PAIRS = (
    # reserved for evaluation
    ("a lake", "a pond"),
    ("weather", "climate"),
    ("a crocodile", "an alligator"),
    # training
    ("a bee", "a wasp"),
    ("a comet", "an asteroid"),
    ("tea", "coffee"),
    ("a violin", "a viola"),
    ("baking soda", "baking powder"),
    ("a frog", "a toad"),
    ("a city", "a town"),
    ("a hurricane", "a typhoon"),
    ("speed", "velocity"),
    ("a star", "a planet"),
    ("a rabbit", "a hare"),
    ("an ocean", "a sea"),
    ("a novel", "a short story"),
    ("a monkey", "an ape"),
    ("a latte", "a cappuccino"),
    ("a democracy", "a republic"),
    ("RAM", "storage"),
    ("a moth", "a butterfly"),
    ("mass", "weight"),
    ("a cold", "the flu"),
    ("a hill", "a mountain"),
    ("a poem", "a song"),
    ("a square", "a rectangle"),
    ("a fruit", "a vegetable"),
)

_PAIR_TEMPLATES = (
    "What is the difference between {} and {}?",
    "Compare {} and {}.",
    "Which is better, {} or {}? Explain.",
    "How are {} and {} similar?",
)

_WRITING_TASKS = (
    # reserved for evaluation
    "an email to my landlord about a broken heater",
    "a birthday message for my grandmother",
    "a short welcome speech for new students",
    # training
    "an email asking my manager for a day off",
    "a thank-you note to a bus driver",
    "a product description for a water bottle",
    "a short advertisement for a bakery",
    "a letter to a pen pal in another country",
    "an apology message to a friend",
    "a short review of a restaurant",
    "a motivational message for a sports team",
    "an invitation to a picnic",
    "a bedtime story about a dragon",
    "a job posting for a barista",
    "a short biography of a fictional inventor",
    "a note to a neighbor about a lost cat",
    "a packing list for a beach holiday",
    "a short mystery story opening",
    "a weekly meal plan",
    "a complaint letter about a late delivery",
    "a speech for a friend's wedding",
    "a description of a sunset",
    "a to-do list for moving house",
    "a short fairy tale",
    "a news headline and summary about a new park",
    "a poem for Mother's Day",
    "a recipe for vegetable soup",
)

_WRITING_TEMPLATES = (
    "Write {}.",
    "Please draft {}.",
    "Can you help me write {}?",
    "Compose {}, keeping it short.",
)

_CODING_TASKS = (
    # reserved for evaluation
    "checks whether a string is a palindrome",
    "returns the largest number in a list",
    # training
    "reverses a string",
    "counts the vowels in a sentence",
    "computes the factorial of a number",
    "returns the Fibonacci numbers up to n",
    "removes duplicates from a list",
    "checks whether a number is prime",
    "sorts a list of words by length",
    "converts Celsius to Fahrenheit",
    "counts how often each word appears in a text",
    "merges two sorted lists",
    "finds the average of a list of numbers",
    "capitalizes the first letter of every word",
    "checks whether two words are anagrams",
    "returns the sum of the digits of a number",
    "flattens a nested list",
    "finds the second smallest number in a list",
    "computes the greatest common divisor of two numbers",
    "converts a number to binary",
)

_CODING_TEMPLATES = (
    "Write a Python function that {}.",
    "Show me a JavaScript function that {}.",
    "How would I write code that {}? Use Python.",
)

_SENTENCES = (
    # reserved for evaluation
    "the meeting got moved because nobody could make it on friday",
    "i think the movie was kind of boring but the music was great",
    # training
    "we need to finish this project soon or the boss will be mad",
    "the cat knocked the glass off the table again",
    "can you send me the file when you get a chance",
    "the weather was terrible so we stayed home all day",
    "i forgot my keys and had to wait outside for an hour",
    "this phone is way too expensive for what it does",
    "the new café downtown has really good sandwiches",
    "our team won the game in the last minute",
    "he said he would call back but he never did",
    "the train was late so i missed the start of the show",
    "my computer keeps crashing when i open too many tabs",
    "the kids loved the museum but got tired quickly",
    "she practiced piano every day for a year",
    "the store ran out of bread before noon",
)

_SENTENCE_TEMPLATES = (
    "Rewrite this sentence to sound more formal: '{}'",
    "Fix the grammar and punctuation: '{}'",
    "Make this sentence more cheerful: '{}'",
    "Summarize in a few words: '{}'",
)

_WORDS = (
    # reserved for evaluation
    "serendipity",
    "meticulous",
    # training
    "ephemeral",
    "resilient",
    "ubiquitous",
    "candid",
    "frugal",
    "benevolent",
    "eloquent",
    "nostalgia",
    "curious",
    "diligent",
    "ambiguous",
    "vivid",
    "tranquil",
    "humble",
    "persistent",
    "whimsical",
)

_WORD_TEMPLATES = (
    "Define the word '{}' and use it in a sentence.",
    "What does '{}' mean? Give two examples.",
    "Give me synonyms for '{}'.",
)

_PHRASES = (
    # reserved for evaluation
    "Where is the nearest pharmacy?",
    # training
    "Good morning, how are you?",
    "I would like a cup of tea, please.",
    "Thank you for your help.",
    "What time does the museum open?",
    "The weather is beautiful today.",
    "Can you recommend a good restaurant?",
    "I am learning to cook.",
    "How much does this cost?",
)

_LANGUAGES = ("French", "Spanish", "German", "Italian")

_ADVICE = (
    # reserved for evaluation
    "staying focused while working from home",
    # training
    "dealing with a difficult coworker",
    "getting over a fear of public speaking",
    "staying motivated to exercise",
    "making a long flight more comfortable",
    "helping a friend who is sad",
    "keeping a tidy home",
    "choosing a first pet",
    "eating more vegetables",
    "spending less time on my phone",
    "preparing for a first day at a new school",
    "sleeping better during hot weather",
)

_ADVICE_TEMPLATES = (
    "Give me some advice on {}.",
    "What are your best tips for {}?",
)


def _arithmetic(rng: random.Random, count: int) -> list[str]:
    templates = (
        "What is {a} plus {b}? Show your work.",
        "What is {a} times {b}?",
        "If I have {a} apples and give away {b}, how many are left?",
        "A train travels {a} kilometers in {b} hours. What is its average speed?",
        "What is {b} percent of {a}?",
        "Is {a} an even or an odd number? Explain.",
        "A shop sells pens for {b} dollars each. How much do {a} pens cost?",
    )
    prompts = []
    for k in range(count):
        a, b = rng.randint(12, 480), rng.randint(2, 45)
        prompts.append(templates[k % len(templates)].format(a=a, b=b))
    return prompts


def _split_reserved(items: Sequence[object], reserved: int) -> tuple[list, list]:
    return list(items[:reserved]), list(items[reserved:])


def builtin_prompts() -> list[str]:
    """Every built-in instruction: `NUM_EVAL_PROMPTS` held-out evaluation prompts first, then
    several thousand training prompts in a fixed shuffled order (so any prefix of the training
    part mixes every family). Deterministic and free of duplicates."""
    rng = random.Random(20240917)
    eval_topics, train_topics = _split_reserved(_TOPICS, 8)
    eval_tasks, train_tasks = _split_reserved(_HOW_TO_TASKS, 4)
    eval_pairs, train_pairs = _split_reserved(_PAIRS, 3)
    eval_writing, train_writing = _split_reserved(_WRITING_TASKS, 3)
    eval_code, train_code = _split_reserved(_CODING_TASKS, 2)
    eval_sentences, train_sentences = _split_reserved(_SENTENCES, 2)
    eval_words, train_words = _split_reserved(_WORDS, 2)
    eval_phrases, train_phrases = _split_reserved(_PHRASES, 1)
    eval_advice, train_advice = _split_reserved(_ADVICE, 1)

    def family(templates: Sequence[str], fillers: Iterable[object]) -> list[str]:
        out = []
        for filler in fillers:
            args = filler if isinstance(filler, tuple) else (filler,)
            out += [t.format(*args) for t in templates]
        return out

    evals = (
        [
            _TOPIC_TEMPLATES[(3 * k) % len(_TOPIC_TEMPLATES)].format(topic)
            for k, topic in enumerate(eval_topics * 3)
        ]
        + family(_HOW_TO_TEMPLATES[:2], eval_tasks)
        + family(_PAIR_TEMPLATES[:1], eval_pairs)
        + family(_WRITING_TEMPLATES[:1], eval_writing)
        + family(_CODING_TEMPLATES[:1], eval_code)
        + family(_SENTENCE_TEMPLATES[:1], eval_sentences)
        + family(_WORD_TEMPLATES[:1], eval_words)
        + [f"Translate '{eval_phrases[0]}' into {lang}." for lang in _LANGUAGES[:1]]
        + family(_ADVICE_TEMPLATES[:1], eval_advice)
        + _arithmetic(random.Random(7), 2)
    )
    evals = list(dict.fromkeys(evals))
    train = (
        family(_TOPIC_TEMPLATES, train_topics)
        + family(_HOW_TO_TEMPLATES, train_tasks)
        + family(_PAIR_TEMPLATES, train_pairs)
        + family(_WRITING_TEMPLATES, train_writing)
        + family(_CODING_TEMPLATES, train_code)
        + family(_SENTENCE_TEMPLATES, train_sentences)
        + family(_WORD_TEMPLATES, train_words)
        + [f"Translate '{p}' into {lang}." for p in train_phrases for lang in _LANGUAGES]
        + family(_ADVICE_TEMPLATES, train_advice)
        + _arithmetic(random.Random(11), 200)
    )
    train = [p for p in dict.fromkeys(train) if p not in set(evals)]
    rng.shuffle(train)
    assert len(evals) == NUM_EVAL_PROMPTS, len(evals)
    return evals + train


def eval_prompts() -> list[str]:
    """The held-out evaluation prompts (never used for training)."""
    return builtin_prompts()[:NUM_EVAL_PROMPTS]


def train_prompts() -> list[str]:
    """The built-in training prompts, in their fixed order."""
    return builtin_prompts()[NUM_EVAL_PROMPTS:]


def read_prompts(paths: Sequence[str | Path]) -> list[str]:
    """Prompts from files: `.jsonl` lines are objects with a `prompt`, `instruction`, `text` or
    `messages` (a chat list whose user turns are joined) field, or JSON strings; any other file
    holds one prompt per non-empty line. Raises ValueError naming the file and line."""
    prompts: list[str] = []
    for path in map(Path, paths):
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                prompts.append(_jsonl_text(line, path, number, ("prompt", "instruction", "text")))
            else:
                prompts.append(line.strip())
    return prompts


def read_texts(paths: Sequence[str | Path]) -> list[str]:
    """Documents from files: a `.jsonl` file holds one document per line (a JSON string or an
    object with a `text`, `content` or `prompt` field); any other file is one document."""
    texts: list[str] = []
    for path in map(Path, paths):
        content = path.read_text(encoding="utf-8")
        if path.suffix != ".jsonl":
            texts.append(content)
            continue
        for number, line in enumerate(content.splitlines(), 1):
            if line.strip():
                texts.append(_jsonl_text(line, path, number, ("text", "content", "prompt")))
    return [t for t in texts if t.strip()]


def _jsonl_text(line: str, path: Path, number: int, fields: Sequence[str]) -> str:
    try:
        value = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path}:{number}: not JSON ({e})") from e
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        for name in fields:
            if isinstance(value.get(name), str):
                return str(value[name])
        messages = value.get("messages")
        if isinstance(messages, list):
            turns = [m.get("content", "") for m in messages if isinstance(m, dict)]
            users = [
                m.get("content", "")
                for m in messages
                if isinstance(m, dict) and m.get("role") == "user"
            ]
            return "\n".join(str(t) for t in (users or turns))
    raise ValueError(f"{path}:{number}: expected a string or an object with one of {list(fields)}")
