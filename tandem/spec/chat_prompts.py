"""General chat prompts for self-distillation: everyday questions, explanations, advice, short
creative tasks, over a few hundred subjects.

An EAGLE head learns the target's behaviour on the prompts it is trained on. A head trained
mostly on code and documentation summaries (what the machine's text offers) accepted 2.0 tokens
per round on prompts like those but 1.4 on ordinary chat questions, so the training mix needs
ordinary chat. The lists below are combined (subject x template, task x template) into tens of
thousands of distinct prompts; `HELD_OUT_QUESTIONS` (train_data.py) never appear among them.
"""

from __future__ import annotations

import random

SUBJECTS = (
    # science and nature
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "earthquakes", "tides",
    "the seasons", "clouds", "lightning", "tornadoes", "hurricanes", "glaciers", "deserts",
    "rainforests", "coral reefs", "the ocean floor", "sharks", "whales", "dolphins", "octopuses",
    "bees", "ants", "butterflies", "spiders", "birds' migration", "owls", "penguins", "elephants",
    "wolves", "cats", "dogs", "horses", "dinosaurs", "fossils", "evolution", "cells", "DNA",
    "genes", "bacteria", "viruses", "the immune system", "vaccines", "antibiotics", "the brain",
    "the human heart", "the lungs", "digestion", "the skeleton", "muscles", "sleep", "dreams",
    "memory", "the five senses", "vision", "hearing", "atoms", "molecules", "chemical reactions",
    "acids and bases", "the periodic table", "gravity", "magnetism", "electricity", "light",
    "sound", "heat", "friction", "energy", "nuclear power", "solar power", "wind power",
    "batteries", "the moon", "the sun", "Mars", "Jupiter", "Saturn's rings", "comets", "stars",
    "galaxies", "the Big Bang", "telescopes", "satellites", "space stations", "rockets",
    "climate change", "the greenhouse effect", "recycling", "plastic pollution", "air pollution",
    "deforestation", "biodiversity", "soil", "trees", "flowers", "mushrooms", "seeds",
    # technology
    "computers", "the internet", "email", "smartphones", "Wi-Fi", "Bluetooth", "GPS",
    "search engines", "social media", "cloud computing", "artificial intelligence",
    "machine learning", "neural networks", "robots", "self-driving cars", "electric cars",
    "3D printing", "virtual reality", "video games", "databases", "encryption", "passwords",
    "computer viruses", "open source software", "operating systems", "compilers",
    "programming languages", "Python", "JavaScript", "web browsers", "websites", "spreadsheets",
    "version control", "unit testing", "debugging", "algorithms", "sorting algorithms",
    "binary numbers", "recursion", "data structures", "hash tables", "linked lists",
    "the command line", "APIs", "microchips", "semiconductors", "lasers", "cameras",
    "television", "radio", "the telephone", "the printing press", "the wheel", "clocks",
    "airplanes", "trains", "bridges", "skyscrapers", "dams", "canals",
    # history and society
    "ancient Egypt", "the pyramids", "ancient Greece", "the Roman Empire", "the Middle Ages",
    "the Renaissance", "the Industrial Revolution", "the French Revolution", "the Vikings",
    "the Silk Road", "the Great Wall of China", "the Olympic Games", "democracy", "elections",
    "taxes", "money", "banks", "inflation", "the stock market", "supply and demand",
    "international trade", "small businesses", "startups", "advertising", "marketing",
    "libraries", "museums", "newspapers", "human rights", "cities", "villages", "farming",
    "languages", "writing systems", "maps", "calendars", "holidays", "weddings", "birthdays",
    # everyday life
    "cooking pasta", "baking bread", "making coffee", "tea", "chocolate", "breakfast",
    "healthy eating", "vegetables", "fruit", "spices", "drinking water", "exercise", "running",
    "swimming", "cycling", "yoga", "walking", "stretching", "meditation", "stress",
    "time management", "procrastination", "habits", "motivation", "goal setting", "budgeting",
    "saving money", "job interviews", "writing a resume", "public speaking", "teamwork",
    "leadership", "negotiation", "friendship", "kindness", "patience", "gratitude",
    "learning a new language", "studying for exams", "reading books", "taking notes",
    "moving to a new city", "travelling abroad", "packing a suitcase", "camping", "hiking",
    "gardening", "houseplants", "cleaning the house", "doing laundry", "pets", "raising a puppy",
    "parenting", "grandparents", "neighbours", "volunteering", "online shopping",
    "first aid", "fire safety", "road safety", "car maintenance", "home repairs",
    # arts and leisure
    "music", "jazz", "classical music", "playing the guitar", "learning the piano", "singing",
    "painting", "drawing", "photography", "poetry", "short stories", "novels", "fairy tales",
    "theatre", "movies", "animation", "comics", "chess", "board games", "puzzles", "football",
    "basketball", "tennis", "the marathon", "mountain climbing", "dancing", "knitting",
    "woodworking", "pottery", "architecture", "fashion", "the color blue", "autumn", "winter",
    "spring", "summer", "rain", "snow", "the sea", "rivers", "mountains",
    "islands", "forests", "sunsets", "a quiet morning", "old friends",
)

SUBJECT_TEMPLATES = (
    "What is {s}?",
    "Explain {s} in simple terms.",
    "Explain {s} to a ten-year-old.",
    "Explain {s} in two sentences.",
    "Give me three interesting facts about {s}.",
    "Tell me five fun facts about {s}.",
    "Why is {s} important?",
    "How does {s} work?",
    "What is the history of {s}?",
    "Summarize what people should know about {s}.",
    "Write a short paragraph about {s}.",
    "Write a short poem about {s}.",
    "Write a haiku about {s}.",
    "Write a limerick about {s}.",
    "Write a short story that involves {s}.",
    "What are the pros and cons of {s}?",
    "What are common misconceptions about {s}?",
    "List five questions a student might ask about {s}.",
    "Give me a quiz with three questions about {s}, with answers.",
    "What is a good book or resource to learn about {s}?",
    "Describe {s} in a few sentences.",
    "Compare {s} with something from everyday life.",
    "What would happen if there were no {s}?",
    "What are the main parts of {s}?",
    "Give me a simple analogy for {s}.",
    "Write a tweet about {s}.",
    "I'm curious about {s}. Where should I start?",
    "Can you tell me something surprising about {s}?",
    "What do scientists or experts still not know about {s}?",
    "Answer in one sentence: what is {s}?",
    "Explain {s} as if I were a complete beginner.",
    "Explain {s} to a university student.",
    "What is the most important thing to understand about {s}?",
    "Give me a one-paragraph overview of {s}.",
    "Make a bullet list of key facts about {s}.",
    "What are three myths about {s}, and what is the truth?",
    "How has {s} changed over the last hundred years?",
    "What is the future of {s}?",
    "Why do people find {s} interesting?",
    "How would you teach {s} in a ten-minute lesson?",
    "Write a short dialogue between a teacher and a student about {s}.",
    "Write a four-line rhyming poem about {s}.",
    "Write a short speech about {s}.",
    "Write the opening paragraph of an essay about {s}.",
    "Write a product description that mentions {s}.",
    "Give me a fun activity for kids related to {s}.",
    "What careers are related to {s}?",
    "What vocabulary words should I know to talk about {s}?",
    "Summarize {s} in exactly three sentences.",
    "What are the benefits and risks of {s}?",
    "Compare {s} and the internet.",
    "What questions should I ask an expert on {s}?",
    "How is {s} connected to everyday life?",
    "What would a good title for a documentary about {s} be? Give three ideas.",
    "Explain {s} using a metaphor.",
    "Write a short news headline and summary about {s}.",
    "What is one experiment or project that helps understand {s}?",
    "What are the different types of {s}?",
    "Who are some famous people associated with {s}?",
)

TASKS = (
    "learn to cook", "make friends in a new city", "fall asleep faster", "stay focused while "
    "studying", "start running", "save money on groceries", "write a good email", "prepare for "
    "a job interview", "learn to code", "keep a plant alive", "clean a cast iron pan", "make "
    "a cup of tea", "boil an egg", "bake cookies", "plan a birthday party", "organize my desk",
    "read more books", "learn to draw", "improve my handwriting", "speak more confidently",
    "deal with stress", "wake up early", "drink more water", "stop procrastinating", "learn a "
    "new language quickly", "memorize a speech", "take better photos", "plan a road trip",
    "pack light for a trip", "choose a laptop", "back up my files", "make a strong password",
    "write a cover letter", "ask for a raise", "give constructive feedback", "apologize to a "
    "friend", "say no politely", "make a budget", "start a vegetable garden", "train my dog to "
    "sit", "care for a cat", "fix a flat bicycle tire", "change a light bulb safely", "unclog a "
    "drain", "remove a coffee stain", "iron a shirt", "sew on a button", "stay warm in winter",
    "keep cool in summer", "build a campfire safely", "read a map", "tie a tie", "set up a "
    "home workout", "stretch after running", "meditate for five minutes", "write a poem",
    "start a journal", "learn the guitar", "sing better", "teach a child to read", "help a "
    "friend who is sad", "host a dinner", "make a smoothie", "cook rice", "make pancakes",
    "choose a good watermelon", "store fresh herbs", "reduce food waste", "recycle properly",
    "use less plastic", "save energy at home", "learn Python", "debug a program", "write a "
    "unit test", "use git", "learn SQL", "sort a list in Python", "read a CSV file in Python",
    "write a for loop in Python", "reverse a string in Python", "check if a number is prime",
    "compute the average of a list", "count words in a text", "find the largest number in a "
    "list", "explain my code to a beginner", "name variables well", "write clean code",
)

TASK_TEMPLATES = (
    "How do I {t}?",
    "How can I {t}?",
    "What is the best way to {t}?",
    "Give me three tips to {t}.",
    "Give me five tips to {t}.",
    "What are some simple steps to {t}?",
    "I want to {t}. Where do I begin?",
    "What mistakes should I avoid when I try to {t}?",
    "Can you explain step by step how to {t}?",
    "What do I need to {t}?",
    "Write a short checklist to {t}.",
    "My friend wants to {t}. What advice should I give?",
    "How long does it usually take to {t}?",
    "Is it hard to {t}? Explain.",
    "Explain to a beginner how to {t}.",
    "What is a common mistake people make when they try to {t}?",
    "Give me a weekly plan to {t}.",
    "In three steps, how do I {t}?",
)

QUESTIONS = (
    "Why is the sky blue?", "Why is the sea salty?", "How do airplanes fly?",
    "How do magnets work?", "Why do cats purr?", "Why do we yawn?", "How do plants grow?",
    "Why do we need sleep?", "How does the heart pump blood?", "What causes thunder?",
    "How far away is the moon?", "Why does ice float?", "What makes a rainbow?",
    "How do birds know where to migrate?", "Why do onions make you cry?",
    "What is the tallest mountain in the world?", "What is the largest ocean?",
    "What is the speed of light?", "How many bones are in the human body?",
    "What is the difference between weather and climate?",
    "What is the difference between a virus and a bacterium?",
    "What is the difference between a for loop and a while loop?",
    "What is the difference between RAM and storage?",
    "What is the difference between a dictionary and a list in Python?",
    "What is a function in programming?", "What is an API?", "What is a variable?",
    "What is the capital of Japan?", "What is the capital of Italy?",
    "What is the capital of Canada?", "Who invented the telephone?",
    "Who painted the Mona Lisa?", "Who wrote Romeo and Juliet?",
    "What is 15 times 12?", "What is the square root of 144?", "Is 91 a prime number?",
    "Convert 100 degrees Fahrenheit to Celsius.", "How many minutes are in a day?",
    "What should I eat before a workout?", "What is a good morning routine?",
    "What are some good hobbies to try?", "What should I do on a rainy weekend?",
    "Suggest a name for a small bakery.", "Suggest three names for a pet turtle.",
    "Write a thank-you note to a teacher.", "Write a birthday message for my sister.",
    "Write a short motivational quote.", "Tell me a joke about computers.",
    "Tell me a short bedtime story.", "Write a riddle and its answer.",
)


def chat_prompts(rng: random.Random) -> list[str]:
    """Every subject x template, task x template and plain question, shuffled by `rng`."""
    out = [t.format(s=s) for s in SUBJECTS for t in SUBJECT_TEMPLATES]
    out += [t.format(t=task) for task in TASKS for t in TASK_TEMPLATES]
    out += list(QUESTIONS)
    rng.shuffle(out)
    return out
