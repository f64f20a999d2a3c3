"""Built-in texts: the BPE training corpus, the prompt variants and the tokenizer test cases.

Changing any text here changes the tokenizer or the fixture, so they are fixed data.
"""

TRAINING_CORPUS = "\n".join([
    # English prose, with contractions and capitals.
    "The quick brown fox jumps over the lazy dog. It's a small model, but it's ours.",
    "We'll test the engine against this reference; they're both reading the same files.",
    "THE ROUTER PICKS EXPERTS. The router picks experts by score plus bias, and I'd say",
    "that's the part people get wrong. You've seen it: the weights use the unbiased score.",
    "Once upon a time, there was a tiny model with thirteen layers and sixteen experts.",
    "Attention residuals mix block snapshots with the running partial sum of the layer.",
    "Every token reads the state, updates it, and the next token reads it again.",
    # Code.
    "fn main() {\n    let x: Vec<u32> = (0..10).map(|i| i * 2).collect();\n"
    "    println!(\"{:?}\", x);\n}\n",
    "def forward(self, x):\n    h = self.norm(x)\n    return self.proj(h) + x\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n",
    "if err != nil {\n\treturn fmt.Errorf(\"read %s: %w\", path, err)\n}\n",
    # JSON.
    '{"model_type": "kimi_k3", "hidden_size": 64, "layers": [1, 2, 3], "ok": true}',
    '{"name": "expert", "shape": [32, 32], "dtype": "U8", "data_offsets": [0, 1024]}',
    # Chinese.
    "我们今天测试一个很小的模型。这个模型有十三层，每一层都有注意力和专家。",
    "中文分词使用汉字连续匹配，标点符号单独处理。北京和上海都是大城市。",
    # Japanese.
    "これは小さなモデルのテストです。東京で会いましょう。カタカナとひらがなを混ぜます。",
    "日本語の文章には漢字、ひらがな、カタカナが使われています。",
    # Korean.
    "안녕하세요. 이것은 작은 모델입니다. 서울에서 만나요. 한국어 문장을 시험합니다.",
    # Arabic.
    "مرحبا بالعالم. هذا نموذج صغير للاختبار. اللغة العربية تكتب من اليمين إلى اليسار.",
    # Russian and Greek.
    "Привет, мир! Это маленькая модель для проверки. Съешь ещё этих мягких булок.",
    "Καλημέρα κόσμε. Το μοντέλο είναι μικρό.",
    # Emoji, digits, whitespace.
    "Emoji: 😀 😃 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🇯🇵 ❤️ ✨ 🚀🚀🚀",
    "Numbers: 0 1 12 123 1234 12345 3.14159 2025-01-31 1,000,000 +44 20 7946 0958",
    "Tabs\tand  double  spaces   and trailing spaces   \nline two\r\nline three\n\n\nend",
    "Mixed: naïve café Zürich Ångström résumé coöperate façade jalapeño",
])

# Prompt variants, tried in order until one gives a comfortable greedy margin (see evaluate.py).
PROMPTS = [
    "The router picks 4 experts: 東京!",
    "Once upon a time, the model said ok.",
    "We test the engine: 東京.",
    "fn main() { let x = 42; }",
    '{"ok": true, "n": 42}',
    "It's a small model, but it's ours.",
    "THE ROUTER: score plus bias.",
    "안녕하세요. 서울!",
    "Hello 😀 world, it's 3.14!",
    "Every token reads the state again.",
    # Longer ones, for a larger --vocab (more merges, fewer tokens per text).
    "Attention residuals mix block snapshots with the running partial sum.",
    "我们今天测试一个很小的模型。这个模型有十三层。",
]

# Tokenizer parity cases: (text, allow_special). With allow_special False, added-token text is
# encoded as ordinary text.
TOKENIZER_CASES = [
    ("", False),
    ("Hello, world!", False),
    ("hello world", False),
    ("The quick brown fox jumps over the lazy dog.", False),
    # Contractions, including upper case and the ones that are not contractions.
    ("It's, we'll, they're, I've, I'm, you'd, don't", False),
    ("IT'S WE'LL THEY'RE I'VE I'M YOU'D DON'T", False),
    ("JOHN'S book, MARY'LL come, it'S odd, we'Re here", False),
    ("'s 'S x's 'quoted' rock'n'roll o'clock", False),
    ("HTTPServer parseJSON camelCaseWord XMLHttpRequest iPhone", False),
    # Digits.
    ("0 1 12 123 1234 12345 1234567890", False),
    ("3.14159 2025-01-31 1,000,000 +44 20 7946 0958", False),
    ("Ⅻ ½ ² ٣٤٥ १२३", False),
    # Whitespace runs.
    ("  leading spaces", False),
    ("trailing spaces   ", False),
    ("a\tb\t\tc", False),
    ("line one\nline two\n\nline four\n", False),
    ("windows\r\nline\r\n\r\nend", False),
    ("spaces   before\n  \n   next", False),
    ("\n\n\n", False),
    ("   ", False),
    (" \t \n x", False),
    ("nbsp\u00a0here and ideographic\u3000space", False),
    # Code and JSON.
    ("fn main() {\n    println!(\"{}\", 1 + 2);\n}\n", False),
    ("def f(x):\n\treturn x**2  # square\n", False),
    ('{"a": 1, "b": [true, false, null], "c": {"d": "e"}}', False),
    ("<div class=\"x\">&amp;</div>", False),
    ("$ ls -la /tmp && echo \"done\" | grep -v '^#'", False),
    # CJK, Japanese, Korean, Arabic.
    ("我们今天测试一个很小的模型。", False),
    ("中文English混合mixed文本", False),
    ("東京で会いましょう。カタカナとひらがな", False),
    ("々〆〇 ぁゝゞ ー", False),
    ("안녕하세요, 서울에서 만나요!", False),
    ("مرحبا بالعالم، هذا اختبار.", False),
    ("Привет, мир! Съешь ещё этих булок.", False),
    ("Ελληνικά: Καλημέρα", False),
    # Combining marks and mixed scripts.
    ("naïve cafe\u0301 Zu\u0308rich", False),
    ("\u0301leading mark", False),
    ("ab\u0301\u0302c D\u0301E\u0301F", False),
    ("Kimi模型K3", False),
    ("abc中def", False),
    # Emoji: ZWJ sequences, skin tones, flags, keycaps, variation selectors.
    ("😀😃😄", False),
    ("👨‍👩‍👧‍👦 family", False),
    ("👍🏽 ok", False),
    ("🇫🇷🇯🇵🇺🇸", False),
    ("1️⃣ #️⃣ ❤️ ✨", False),
    ("🚀🚀🚀 launch!!!", False),
    # Punctuation runs and odd characters.
    ("...!!! ??? --- ***", False),
    ("a,b;c:d", False),
    ("ſtrange long s: it'ſ", False),
    ("tab\t'quoted'\t", False),
    # Added-token text encoded as ordinary text.
    ("<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|>", False),
    ("[BOS] not special here", False),
    # Added tokens recognised.
    ("[BOS]hello", True),
    ("<|open|>message role=\"user\"<|sep|>Hello!<|close|>message<|sep|><|end_of_msg|>", True),
    ("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>", True),
    ("text [EOS] more<|reserved_token_%d|>x", True),
]
