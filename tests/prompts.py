"""The 16 varied chat prompts of the SmolLM2 reference tests (English, Indonesian, code, a list, a long one)."""


def _long_prompt() -> str:
    lines = [f"Day {i}: the sensor in greenhouse {i % 7} read {20 + (i * 37) % 15} degrees and "
             f"{40 + (i * 53) % 50} percent humidity; the tomatoes in row {i % 11} were watered "
             f"{1 + i % 3} times." for i in range(1, 42)]
    return "Here is a log of a greenhouse:\n" + "\n".join(lines) + "\nWhich day was the warmest, and why?"


PROMPTS: list[str] = [
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Apa ibu kota Indonesia dan mengapa akan dipindahkan?",
    "Tuliskan tiga tips untuk belajar bahasa Inggris.",
    "Write a Python function that checks whether a number is prime.",
    "def fibonacci(n):\n    # complete this function",
    "List five fruits that are red.",
    "Give me a numbered list of steps to make a cup of tea.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Write a short poem about lightning over the sea.",
    "What is 17 times 23? Show your working.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Write a SQL query that counts the orders per customer.",
    "Why is the sky blue?",
    "Ceritakan sebuah dongeng singkat tentang kancil.",
    _long_prompt(),
]
