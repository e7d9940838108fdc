"""Import format ``locomo``.

``locomo10.json``. Session ``{sample_id}_session_{N}`` per ``session_N`` (date keys without a
session are skipped); role = speaker name; an image turn's content gets
`` [shares image: {blip_caption}]``. Every QA becomes question ``{sample_id}_q{idx}`` whose
haystack is all sessions of its conversation in N order. Gold = the sessions named by the
evidence dia_ids, after normalising malformed ids (``"D8:6; D9:17"`` -> two ids, ``"D:11:26"``
-> ``D11:26``, ``"D30:05"`` -> ``D30:5``). Decisions: by default (``on_bad_evidence: drop``, as the
official file needs) a token that cannot be parsed (``"D"``) or an id whose *session* does not
exist is dropped with a warning naming conversation, QA and value, recorded in the question's
``extra.evidence_dropped`` and in the import summary (``on_bad_evidence: error`` stops); an id whose
session exists but whose turn does not is recoverable (the gold unit is the session): kept, with
a warning and ``extra.evidence_unresolved_turns``; an empty evidence string is skipped.
Category 5 (adversarial) QAs without ``answer`` are kept with ``answer`` = ``adversarial_answer``
(or ``""``) and ``extra`` ``{"adversarial": true, "no_answer": true}``.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

from ...errors import InputError
from ..model import Dataset, DatasetBuilder, Question, answer_text, check_role, check_text, require
from .reading import _load_json_list, _progress, _read_raw, check_turn_size

log = logging.getLogger(__name__)

LOCOMO_CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
_EVIDENCE = re.compile(r"D:?(\d+):(\d+)", re.IGNORECASE)


def normalise_evidence(raw: str) -> tuple[list[tuple[int, int]], list[str]]:
    """``"D8:6; D9:17"`` -> [(8, 6), (9, 17)]; ``"D:11:26"`` -> (11, 26); ``"D30:05"`` -> (30, 5).

    Returns the parsed (session, turn) pairs and the tokens that could not be parsed.
    """
    pairs, bad = [], []
    for tok in re.split(r"[;,\s]+", raw):
        tok = tok.strip().strip(".:")
        if not tok:
            continue
        m = _EVIDENCE.fullmatch(tok)
        if m:
            pairs.append((int(m.group(1)), int(m.group(2))))
        else:
            bad.append(tok)
    return pairs, bad


def convert_locomo(uri: str, dataset: str | None = None, on_bad_evidence: str = "drop") -> tuple[Dataset, dict]:
    convs = _load_json_list(_read_raw(uri), uri, what="conversation", id_key="sample_id")
    dataset = dataset or "locomo"
    b = DatasetBuilder(uri)
    st: Counter = Counter()
    examples: list[dict] = []  # dropped evidence values, for the import summary (first 20)
    for ci, conv in enumerate(_progress(convs, desc="locomo", unit="conv")):
        citem = f"conversation #{ci}"
        if not isinstance(conv, dict):
            raise InputError(f"expected an object, got {type(conv).__name__}", file=uri, item=citem)
        sample = conv.get("sample_id")
        sample = str(sample) if sample not in (None, "") else f"conv{ci}"
        citem = f"conversation '{sample}'"
        c = require(conv, "conversation", dict, file=uri, item=citem)
        numbers = sorted(int(m.group(1)) for k in c if (m := re.fullmatch(r"session_(\d+)", k)))
        if not numbers:
            raise InputError("no session_N keys", file=uri, item=citem, field="conversation")
        hay, dates = [], []
        turns_of: dict[int, set[int]] = {}
        sid_of: dict[int, str] = {}
        for n in numbers:
            key = f"session_{n}"
            sess = c[key]
            if not isinstance(sess, list):
                raise InputError(f"expected a list of turns, got {type(sess).__name__}", file=uri, item=citem,
                                 field=f"conversation.{key}")
            if not sess:
                raise InputError("session is empty (no turns)", file=uri, item=citem, field=f"conversation.{key}")
            turns, dia = [], set()
            for k, t in enumerate(sess):
                f = f"conversation.{key}[{k}]"
                if not isinstance(t, dict):
                    raise InputError(f"a turn must be an object, got {type(t).__name__}", file=uri, item=citem, field=f)
                for name in ("speaker", "text"):
                    if name not in t:
                        raise InputError("missing", file=uri, item=citem, field=f"{f}.{name}")
                    if not isinstance(t[name], str):
                        raise InputError(f"expected str, got {type(t[name]).__name__}", file=uri, item=citem,
                                         field=f"{f}.{name}")
                speaker, text = t["speaker"], t["text"]
                check_role(speaker, file=uri, item=citem, field=f"{f}.speaker")
                check_text(text, file=uri, item=citem, field=f"{f}.text")
                if t.get("blip_caption"):
                    text = f"{text} [shares image: {t['blip_caption']}]"
                    st["image_turns"] += 1
                check_turn_size(text, file=uri, item=citem, field=f"{f}.text")
                turns.append({"role": speaker, "content": text})
                pairs, _ = normalise_evidence(str(t.get("dia_id", "")))
                dia.update(tt for ss, tt in pairs if ss == n)
            date = c.get(f"{key}_date_time")
            date = str(date) if date not in (None, "") else None
            sid = b.add_session(f"{sample}_session_{n}", turns, date, item=citem, field=f"conversation.{key}")
            hay.append(sid)
            dates.append(date)
            turns_of[n], sid_of[n] = dia, sid
            st["sessions"] += 1
            st["turns"] += len(turns)
        st["date_keys_without_session"] += sum(
            1 for k in c if (m := re.fullmatch(r"session_(\d+)_date_time", k)) and f"session_{m.group(1)}" not in c)
        qas = require(conv, "qa", list, file=uri, item=citem)
        for qi, qa in enumerate(qas):
            qitem = f"{citem} qa #{qi}"
            question = require(qa, "question", str, file=uri, item=qitem)
            category = require(qa, "category", (int, str), file=uri, item=qitem)
            try:
                category = int(category)
            except ValueError as e:
                raise InputError(f"expected an integer category, got {category!r}", file=uri, item=qitem,
                                 field="category") from e
            extra: dict[str, Any] = {"category": category}
            if "answer" in qa and qa["answer"] is not None:
                answer = answer_text(qa["answer"], file=uri, item=qitem)
            elif category == 5:
                adv = qa.get("adversarial_answer")
                answer = answer_text(adv, file=uri, item=qitem, field="adversarial_answer") if adv is not None else ""
                extra.update(adversarial=True, no_answer=True)
                st["adversarial_without_answer"] += 1
            else:
                raise InputError("missing", file=uri, item=qitem, field="answer")
            if category == 5:
                extra["adversarial"] = True
            if qa.get("adversarial_answer") is not None:
                extra["adversarial_answer"] = str(qa["adversarial_answer"])
            evidence = qa.get("evidence", [])
            if not isinstance(evidence, list):
                raise InputError(f"expected list, got {type(evidence).__name__}", file=uri, item=qitem,
                                 field="evidence")
            gold_n: list[int] = []
            ids, dropped, unresolved = [], [], []
            for ei, raw in enumerate(evidence):
                if not isinstance(raw, str):
                    raise InputError(f"expected a dia_id string, got {raw!r}", file=uri, item=qitem,
                                     field=f"evidence[{ei}]")
                pairs, bad = normalise_evidence(raw)
                if bad:
                    if on_bad_evidence != "drop":
                        raise InputError(f"malformed dia_id {bad[0]!r} in {raw!r}", file=uri, item=qitem,
                                         field=f"evidence[{ei}]")
                    # parse what can be parsed ('D8:6 D' keeps D8:6), drop the rest, say so
                    for tok in bad:
                        dropped.append(tok)
                        log.warning("%s: %s: evidence[%d]: malformed dia_id %r in %r: dropped", uri, qitem, ei,
                                    tok, raw)
                        if len(examples) < 20:
                            examples.append({"item": qitem, "value": raw, "dropped": tok})
                if len(pairs) != 1 or raw.strip() != f"D{pairs[0][0]}:{pairs[0][1]}":
                    st["evidence_ids_normalised"] += 1
                for sn, tn in pairs:
                    norm = f"D{sn}:{tn}"
                    if sn not in sid_of:
                        if on_bad_evidence == "drop":
                            dropped.append(norm)
                            log.warning("%s: %s: evidence %s names session %d, which does not exist: dropped",
                                        uri, qitem, norm, sn)
                            if len(examples) < 20:
                                examples.append({"item": qitem, "value": raw,
                                                                        "dropped": norm})
                            continue
                        raise InputError(f"evidence {raw!r} names session {sn}, which does not exist "
                                         f"(sessions: {numbers[0]}..{numbers[-1]})", file=uri, item=qitem,
                                         field=f"evidence[{ei}]")
                    if tn not in turns_of[sn]:
                        unresolved.append(norm)
                        log.warning("%s: %s: evidence %s: session %d has no turn %d; keeping the session as gold",
                                    uri, qitem, norm, sn, tn)
                    ids.append(norm)
                    if sn not in gold_n:
                        gold_n.append(sn)
            if ids:
                extra["evidence"] = ids
            if dropped:
                extra["evidence_dropped"] = dropped
                st["evidence_ids_dropped"] += len(dropped)
            if unresolved:
                extra["evidence_unresolved_turns"] = unresolved
                st["evidence_ids_unresolved_turn"] += len(unresolved)
            if not gold_n:
                extra["no_evidence"] = True
                st["qa_without_evidence"] += 1
            gold = [sid_of[n] for n in numbers if n in gold_n]
            b.add_question(Question(f"{sample}_q{qi}", dataset, question, answer, list(hay), gold,
                                    question_type=LOCOMO_CATEGORIES.get(category, f"category-{category}"),
                                    haystack_dates=list(dates), extra=extra))
            st["qa"] += 1
    ds = b.build()
    out = {"conversations": len(convs), **dict(sorted(st.items()))}
    if examples:
        out["evidence_dropped_examples"] = examples
    return ds, out
