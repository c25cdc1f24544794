"""Verifiers score what the answer says, and a sympy bomb costs at most a time limit on any thread and in every mode.

MATH: only ``=`` is read as an answer (every relation, arrow, equivalence and logical connective that LaTeX,
sympy's printer and parser, or Unicode know scores 0), a content that does not parse as LaTeX is not read as the
number math-verify's plain fallback finds in it, and bombs (towers, huge factorials, a polynomial to a large power,
...) are refused before sympy computes them, from a thread other than the main one and in the thread, inline and
process scoring modes. GSM8K: the answer is the whole number token; fractions, exponents, expressions, repeated dots
and trailing letters score 0 in both modes. The time limit itself (``sara.envs.tasks.timelimit``) interrupts a
helper thread and leaves nothing pending behind."""

from __future__ import annotations

import threading
import time
import unicodedata
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sara.envs.tasks import gsm8k
from sara.envs.tasks.scoring import BatchScorer
from sara.envs.tasks.timelimit import call_with_time_limit

FAST = settings(max_examples=120, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def math():
    pytest.importorskip("math_verify")
    from sara.envs.tasks import math

    assert math.verify("\\boxed{5}", answer="5") == 1.0  # imports sympy and math-verify once
    return math


def in_thread(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run in a thread other than the main one: ``(value, seconds)``."""
    out = []
    t = time.monotonic()
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    thread.join(60)
    assert out, f"{fn.__name__} did not return from a non-main thread within 60 s"
    return out[0], time.monotonic() - t


# ---------------------------------------------------------------------------------------- MATH: relations
LATEX_RELATIONS = """
le leq ge geq lt gt ne neq equiv models prec succ sim perp preceq succeq simeq mid ll gg asymp parallel subset
supset approx bowtie subseteq supseteq cong Join sqsubset sqsupset smile sqsubseteq sqsupseteq doteq frown in ni
notin owns propto vdash dashv not leftarrow gets rightarrow to leftrightarrow Leftarrow Rightarrow Leftrightarrow
mapsto hookleftarrow hookrightarrow leftharpoonup leftharpoondown rightharpoonup rightharpoondown rightleftharpoons
longleftarrow longrightarrow longleftrightarrow Longleftarrow Longrightarrow Longleftrightarrow longmapsto iff
implies impliedby uparrow downarrow updownarrow Uparrow Downarrow Updownarrow nearrow searrow swarrow nwarrow leadsto
leqq leqslant eqslantless lesssim lessapprox approxeq lessdot lll lessgtr lesseqgtr lesseqqgtr doteqdot risingdotseq
fallingdotseq backsim backsimeq subseteqq Subset preccurlyeq curlyeqprec precsim precapprox vartriangleleft
trianglelefteq vDash Vvdash smallsmile smallfrown bumpeq Bumpeq geqq geqslant eqslantgtr gtrsim gtrapprox gtrdot ggg
gtrless gtreqless gtreqqless eqcirc circeq triangleq thicksim thickapprox supseteqq Supset succcurlyeq curlyeqsucc
succsim succapprox vartriangleright trianglerighteq Vdash shortmid shortparallel between pitchfork varpropto
blacktriangleleft therefore backepsilon blacktriangleright because nless nleq nleqslant nleqq lneq lneqq lvertneqq
lnsim lnapprox nprec npreceq precneqq precnsim precnapprox nsim nshortmid nmid nvdash nvDash ntriangleleft
ntrianglelefteq nsubseteq subsetneq varsubsetneq subsetneqq varsubsetneqq ngtr ngeq ngeqslant ngeqq gneq gneqq
gvertneqq gnsim gnapprox nsucc nsucceq succneqq succnsim succnapprox ncong nshortparallel nparallel nVDash nVdash
ntriangleright ntrianglerighteq nsupseteq nsupseteqq supsetneq varsupsetneq supsetneqq varsupsetneqq dashrightarrow
dashleftarrow leftleftarrows leftrightarrows Lleftarrow twoheadleftarrow leftarrowtail looparrowleft leftrightharpoons
curvearrowleft circlearrowleft Lsh upuparrows upharpoonleft downharpoonleft multimap leftrightsquigarrow
rightrightarrows rightleftarrows twoheadrightarrow rightarrowtail looparrowright curvearrowright circlearrowright Rsh
downdownarrows upharpoonright downharpoonright rightsquigarrow nleftarrow nrightarrow nLeftarrow nRightarrow
nleftrightarrow nLeftrightarrow Coloneqq eqqcolon Eqqcolon eqcolon approxcolon colonapprox colonsim simcolon
xrightarrow xleftarrow xRightarrow xLeftarrow xleftrightarrow xLeftrightarrow xmapsto xhookrightarrow nequiv divides
land lor lnot neg wedge vee veebar barwedge curlywedge curlyvee mathrel stackrel lhd rhd unlhd unrhd relbar Relbar
""".split()
"""LaTeX relations, arrows, equivalences and logical connectives (LaTeX, amssymb, mathtools)."""


def _sympy_relations() -> list[str]:
    """What sympy writes between two operands for its relations and logic, and the operators it parses (none
    without sympy, which comes with the ``math`` extra)."""
    try:
        import sympy as sp
        from sympy.core.relational import Relational
    except ImportError:
        return []
    a, b = sp.symbols("a b")
    binary = (sp.Lt, sp.Le, sp.Gt, sp.Ge, sp.Ne, sp.Implies, sp.Equivalent, sp.Xor, sp.And, sp.Or, sp.Lambda)
    printed = [sp.latex(f(a, b)) for f in binary] + [sp.latex(sp.Contains(a, sp.S.Reals))]
    printed = [p.replace(r"\left(", "").replace(r"\right)", "").replace(r"\mathbb{R}", "b") for p in printed]
    ops = [p.strip()[1:-1].strip() for p in printed] + [sp.latex(sp.Not(a)).replace("a", "").strip()]
    return ops + [op for op in Relational.ValidRelationOperator if op and not op.isalpha() and op != "=="]


ASCII_RELATIONS = ["<", ">", "<=", ">=", "!=", "<>", "=<", "=>", "->", "<-", "<->", "~", "~=", "|", "+=", "-=", "*=",
                   "/=", "%=", "^=", "=/="]
ALLOWED_OPERATORS = set("\u00b1\u00d7\u00f7\u2212\u2213\u2216\u2217\u2218\u2219\u221a\u221b\u221c\u221e\u2229\u222a"
                        "\u22c5\u2044")
"""Unicode mathematical symbols an answer may use: ± × ÷ − ∓ ∖ ∗ ∘ ∙ √ ∛ ∜ ∞ ∩ ∪ ⋅ ⁄."""
ARROWS = [range(0x2190, 0x2200), range(0x27F0, 0x2800), range(0x2900, 0x2980)]
MATH_BLOCKS = [range(0x2200, 0x2300), range(0x27C0, 0x27F0), range(0x2980, 0x2A00), range(0x2A00, 0x2B00)]
UNICODE_RELATIONS = sorted({chr(c) for r in ARROWS for c in r} | {
    chr(c) for r in MATH_BLOCKS for c in r if unicodedata.category(chr(c)) == "Sm" and chr(c) not in ALLOWED_OPERATORS})
ALL_RELATIONS = ["\\" + n for n in LATEX_RELATIONS] + ASCII_RELATIONS + UNICODE_RELATIONS


def test_the_relation_lists_are_whole():
    pytest.importorskip("sympy")
    assert len(LATEX_RELATIONS) > 250 and len(UNICODE_RELATIONS) > 600
    sympy_ops = _sympy_relations()
    assert {"\\Rightarrow", "\\Leftrightarrow", "\\veebar", "\\wedge", "\\vee", "\\in", "\\mapsto", "\\neg", "<",
            "\\leq", "\\neq", "<>"} <= set(sympy_ops), sympy_ops


@pytest.mark.parametrize("relation", ALL_RELATIONS + _sympy_relations())
def test_every_relation_is_seen(relation):
    from sara.envs.tasks.mathguard import relations

    assert relations(f"6 {relation} 5"), relation
    assert relations(f"x{relation}5") or relation[0] == "\\", relation  # a command needs a space or a non-letter


@pytest.mark.parametrize("content", [
    r"6 \equiv 5", r"6 \to 5", r"6 \implies 5", r"6 \iff 5", r"6 \Leftrightarrow 5", r"6 \sim 5", r"6 \mapsto 5",
    r"6 \Longrightarrow 5", r"x \approx 5", r"x \in \{5\}", r"6 \coloneqq 5", "6 := 5", "x += 5", "6 | 5", "6 ~ 5",
    r"6 \lor 5", r"6 \neq 5", "6 \u2261 5", "6 \u2192 5", "6 = 5", "5 = 6",
])
def test_the_issue_relations_score_zero(math, content):
    assert math.verify(f"so \\boxed{{{content}}}", answer="5") == 0.0


@pytest.mark.parametrize("content", [r"6 \foo 5", r"6 \oplus 5", r"6 \star 5", r"6 \hline 5", r"6 \# 5", "6 & 5",
                                     r"6 \\ 5", r"6 \colon 5", r"6 \qed 5"])
def test_content_that_does_not_parse_is_not_its_last_number(math, content):
    assert math.verify(f"\\boxed{{{content}}}", answer="5") == 0.0


@pytest.mark.parametrize(("content", "gold", "expected"), [
    ("x = 5", "5", 1.0), ("x := 5", "5", 1.0), (r"x \coloneqq 5", "5", 1.0), ("2+3=5", "5", 1.0), ("5", "5", 1.0),
    (r"\frac{10}{2}", "5", 1.0), (r"x \le 3", r"x \le 3", 1.0), (r"3 \ge x", r"x \le 3", 1.0),
    ("x < 3", r"x \le 3", 0.0), (r"x \ne 3", r"x \neq 3", 1.0), ("y = 2x+3", "y=2x+3", 1.0),
    (r"5 \text{ cm}", "5", 1.0), (r"(-\infty, 2) \cup (3, \infty)", r"(-\infty,2)\cup(3,\infty)", 1.0),
    (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1.0), ("|x-1|", "|x-1|", 1.0),
])
def test_assignments_and_the_gold_relations_still_score(math, content, gold, expected):
    assert math.verify(f"\\boxed{{{content}}}", answer=gold) == expected


@settings(max_examples=150, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(relation=st.sampled_from(ALL_RELATIONS + _sympy_relations()),
       lhs=st.sampled_from(["6", "x", "5", r"\frac{10}{2}", "2+3", "y"]),
       rhs=st.sampled_from(["5", r"\frac{10}{2}", "5.0", "2+3"]), space=st.sampled_from([" ", "  "]))
def test_any_relation_but_assignment_scores_zero(math, relation, lhs, rhs, space):
    content = f"{lhs}{space}{relation}{space}{rhs}"
    assert math.verify(f"\\boxed{{{content}}}", answer="5") == 0.0, content
    assert math.verify(f"\\boxed{{{lhs}{space}={space}{rhs}}}", answer="5") == (0.0 if lhs == "6" else 1.0)


# ------------------------------------------------------------------------------------------ MATH: bombs
BOMBS = [
    "(x+y+z+1)^{9999}", "(x+1)^{9999}", "((9^{999})^{999})^{999}", "9^{{9}^{9}}", r"9^{9999 \cdot 9999}",
    r"9^{\frac{{9}^{9}}{1}}", "(9^{99}+1)!", r"(999 \cdot 999)!", "{10^{9999}}!", "(10^{60})!", "7!!!",
    r"{99999 \choose 50000}", r"\binom{9999}{5000}", r"\dbinom{10^{60}}{10^{30}}", r"\Gamma(9999^{9999})",
    r"\Gamma\,(99999999)", r"\exp(\exp(\exp(99)))", r"\exp(10^{60})", r"\left(10^{9999}\right)^{9999}",
    r"\sqrt{10^{9999}+1}", r"\begin{pmatrix}x&1\\1&x\end{pmatrix}^{9999}", r"\operatorname{eye}(99999)",
    r"\operatorname{zeros}(99999, 99999)", r"\det\begin{pmatrix}a&b\\c&d\end{pmatrix}", r"\gcd(9^{99}, 3)",
    r"\sin(10^{9999})", "x^{9999}=1", "(1.0001)^{10^{15}}", r"\int_0^1 x^{9999} dx", r"\sum_{k=1}^{10^{9}} k",
    "9^{9^{9^{9}}}", "9**9**9**9", "2^{2^{2^{2^{2}}}}",
]


def _refused(math, content: str) -> bool:
    """Whether the text guard or the bounds on the parsed expression refuse ``content``."""
    from math_verify import LatexExtractionConfig, parse

    from sara.envs.tasks.mathguard import within_bounds

    if not math.safe_for_sympy(content):
        return True
    parsed = parse(f"\\boxed{{{content}}}", [LatexExtractionConfig()], parsing_timeout=None)
    return not all(within_bounds(p) for p in parsed)


@pytest.mark.parametrize("bomb", BOMBS)
def test_every_bomb_is_refused_before_sympy_computes_it(math, bomb):
    finished, refused = call_with_time_limit(lambda: _refused(math, bomb), 10.0)  # parsing it must not compute it
    assert finished and refused, bomb


def test_every_bomb_scores_zero_at_once_from_a_non_main_thread(math):
    for gold in ("5", "x = 1"):
        for bomb in BOMBS:
            score, seconds = in_thread(math.verify, f"\\boxed{{{bomb}}}", answer=gold, time_limit_s=60.0)
            assert score == 0.0 and seconds < 2.0, (bomb, gold, score, seconds)  # refused: no time limit needed


def test_work_within_bounds_stops_at_the_time_limit_on_any_thread(math):
    slow = r"\boxed{(x+y+1)^{60}}"  # within the bounds, but sympy's comparison takes seconds
    assert not _refused(math, "(x+y+1)^{60}")
    score, seconds = in_thread(math.verify, slow, answer="5", time_limit_s=0.5)
    assert score == 0.0 and seconds < 3.0, seconds
    score, seconds = in_thread(math.verify, "\\boxed{\\frac{10}{2}}", answer="5", time_limit_s=0.5)
    assert score == 1.0  # the helper thread ended cleanly: the next call is unaffected


def math_through_a_wrapper(completion: str, **answer: object) -> float:
    """The MATH verifier behind a plain function (no ``thread_safe`` mark): what the thread / inline modes run."""
    from sara.envs.tasks import math

    return math.verify(completion, **answer)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["thread", "inline", "process"])
def test_bombs_cost_at_most_the_time_limit_in_every_scoring_mode(math, mode):
    completions = [f"\\boxed{{{b}}}" for b in BOMBS[:12]] + ["\\boxed{(x+y+1)^{60}}", "\\boxed{5}"]
    verifier = math.verify if mode == "process" else math_through_a_wrapper
    with BatchScorer(verifier, mode=mode, timeout_s=10.0, workers=1) as scorer:
        scorer.score(["\\boxed{1}"], [{"answer": "1"}])  # a worker imports sympy: its start is not the bombs' cost
        result, seconds = in_thread(scorer.score, completions, [{"answer": "5"}] * len(completions))
    assert list(result.rewards) == [0.0] * (len(completions) - 1) + [1.0], result
    assert seconds < 15.0, seconds  # one call to the time limit (3 s + grace), the bombs refused at once


# ------------------------------------------------------------------------------------------ time limit
def _spin() -> None:
    while True:
        pass


def test_the_time_limit_interrupts_a_helper_and_leaves_nothing_pending():
    (finished, value), seconds = in_thread(call_with_time_limit, _spin, 0.2)
    assert (finished, value) == (False, None) and seconds < 2.0
    assert call_with_time_limit(lambda: 42, 1.0) == (True, 42)
    with pytest.raises(ZeroDivisionError):
        call_with_time_limit(lambda: 1 / 0, 1.0)
    calls = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        calls += 1

    threading.setprofile(profile)  # an interruption no thread received would stall a profiled thread
    try:
        result, seconds = in_thread(lambda: sum(abs(i) for i in range(20_000)))
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    assert result == sum(range(20_000)) and calls > 20_000 and seconds < 5.0


# ------------------------------------------------------------------------------------------------ GSM8K
@st.composite
def numbers(draw) -> tuple[str, Fraction]:
    """A number as a completion may write it (sign, ``$``, thousands separators, decimals) and its value."""
    whole = draw(st.integers(0, 10**9))
    grouped = draw(st.booleans())
    text = f"{whole:,}" if grouped else str(whole)
    value = Fraction(whole)
    if draw(st.booleans()):
        frac = draw(st.text("0123456789", min_size=1, max_size=4))
        text, value = f"{text}.{frac}", value + Fraction(int(frac), 10 ** len(frac))
    sign = draw(st.sampled_from(["", "-", "+"]))
    text = draw(st.sampled_from([f"{sign}{text}", f"{sign}${text}", f"${sign}{text}"]))
    return text, -value if sign == "-" else value


SAY = {"strict": "The answer is\n#### {}", "flexible": "So the answer is {}"}
AFTER = ["", ".", " dollars.", "!", "\n", ". The end", "**"]


@FAST
@given(number=numbers(), mode=st.sampled_from(["strict", "flexible"]), after=st.sampled_from(AFTER))
def test_a_whole_number_token_scores_its_value(number, mode, after):
    text, value = number
    completion = SAY[mode].format(text + after)
    gold = str(value.numerator) if value.denominator == 1 else str(float(value))
    if Fraction(gold) == value:
        assert gsm8k.verify(completion, answer=gold, mode=mode) == 1.0, completion
    assert gsm8k.verify(completion, answer=str(value.numerator + 1), mode=mode) == 0.0, completion


INTS = st.integers(0, 10**6).map(str)
DECIMALS = st.tuples(INTS, st.integers(0, 999)).map(lambda t: f"{t[0]}.{t[1]}")
NON_NUMBERS = {  # class -> (token, numbers a wrong reading would find in it)
    "fraction": st.tuples(INTS, INTS).map(lambda t: (f"{t[0]}/{t[1]}", t)),
    "exponent": st.tuples(INTS, st.integers(0, 99).map(str), st.sampled_from(["e", "E", "e+", "^", "**"])).map(
        lambda t: (f"{t[0]}{t[2]}{t[1]}", t[:2])),
    "latex exponent": st.tuples(INTS, st.integers(0, 99).map(str)).map(lambda t: (f"{t[0]}^{{{t[1]}}}", t)),
    "expression": st.tuples(INTS, INTS, st.sampled_from(["-", "+", "*", "x"])).map(
        lambda t: (f"{t[0]}{t[2]}{t[1]}", t[:2])),
    "repeated dots": st.tuples(DECIMALS, st.integers(0, 99).map(str)).map(
        lambda t: (f"{t[0]}.{t[1]}", (t[0], t[1], t[0].split(".")[1] + "." + t[1]))),
    "trailing letters": st.tuples(st.one_of(INTS, DECIMALS), st.text("abcdefghijklmnopqrstuvwxyzABCDEFXYZ",
                                                                      min_size=1, max_size=4)).map(
        lambda t: (f"{t[0]}{t[1]}", (t[0],))),
}


@pytest.mark.parametrize("kind", sorted(NON_NUMBERS))
def test_a_token_that_is_not_a_number_scores_zero(kind):
    @FAST
    @given(case=NON_NUMBERS[kind], mode=st.sampled_from(["strict", "flexible"]), after=st.sampled_from(AFTER))
    def check(case, mode, after):
        token, pieces = case
        completion = SAY[mode].format(token + after)
        for gold in {*pieces, *(p.split(".")[0] for p in pieces)}:
            assert gsm8k.verify(completion, answer=gold, mode=mode) == 0.0, (kind, completion, gold)

    check()


@pytest.mark.parametrize(("completion", "gold"), [
    ("#### 1/2", "1"), ("#### 1/2", "0.5"), ("#### 72e5", "72"), ("#### 72e5", "7200000"), ("#### 5.5.5", "5.5"),
    ("#### 2^10", "2"), ("#### 2^10", "1024"), ("#### 10-3", "10"), ("#### 10-3", "7"), ("#### 14th", "14"),
    ("The answer is 1/2", "2"), ("The answer is 72e5", "5"), ("The answer is 2^{10}", "10"),
    (r"The answer is \frac{1}{2}", "2"), ("It is 5.5.5", "5"), ("It is 10-3", "3"), (r"\sqrt{16}", "16"),
])
def test_the_issue_cases_score_zero_in_both_modes(completion, gold):
    assert gsm8k.verify(completion, answer=gold) == 0.0
    assert gsm8k.verify(completion.replace("#### ", "It is "), answer=gold, mode="flexible") == 0.0


@pytest.mark.parametrize(("completion", "gold", "mode"), [
    ("#### 1,234.", "1234", "strict"), ("#### **14**", "14", "strict"), ("#### 50%", "50", "strict"),
    ("#### .5", "0.5", "strict"), ("#### - 7 degrees", "-7", "strict"), ("#### 72</s>", "72", "strict"),
    ("Natalia sold <<48/2=24>>24 clips", "24", "flexible"), ("so 3+2=5 apples", "5", "flexible"),
    (r"\boxed{14}", "14", "flexible"), ("$14$.", "14", "flexible"), ("1,2,3", "3", "flexible"),
])
def test_numbers_around_other_text_still_score(completion, gold, mode):
    assert gsm8k.verify(completion, answer=gold, mode=mode) == 1.0
