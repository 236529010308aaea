"""A small conversation in LoCoMo's format, made for these tests (the real data is read from ../shared)."""

FILLER = "We talked about the weather, the traffic and what to cook for dinner tonight, number {}."


def locomo_record(filler: int = 30) -> dict:
    """Two sessions: the facts open the first, then `filler` turns of small talk in each session."""
    Turn = tuple[str, str, str | None]
    first: list[Turn] = [
        ("Caroline", "I went to a LGBTQ support group yesterday and it was so powerful.", None),
        ("Melanie", "That's great! I painted a sunrise last week.", "a painting of a sunrise over a lake"),
        ("Caroline", "I am researching adoption agencies these days.", None),
    ]
    second: list[Turn] = [("Melanie", "My kids loved the camping trip to the mountains.", None)]
    sessions: dict[str, object] = {}
    for number, (date, opening) in enumerate(
        [("1:56 pm on 8 May, 2023", first), ("10:00 am on 25 May, 2023", second)], start=1
    ):
        turns: list[Turn] = [
            *opening,
            *((["Caroline", "Melanie"][i % 2], FILLER.format(i), None) for i in range(filler)),
        ]
        sessions[f"session_{number}_date_time"] = date
        sessions[f"session_{number}"] = [
            {"speaker": speaker, "dia_id": f"D{number}:{i}", "text": text}
            | ({"img_url": ["http://example.invalid/x.jpg"], "blip_caption": caption} if caption else {})
            for i, (speaker, text, caption) in enumerate(turns, start=1)
        ]
    return {
        "sample_id": "conv-test",
        "conversation": {"speaker_a": "Caroline", "speaker_b": "Melanie", **sessions},
        "qa": [
            {
                "question": "When did Caroline go to the LGBTQ support group?",
                "answer": "7 May 2023",
                "evidence": ["D1:1"],
                "category": 2,
            },
            {"question": "What did Melanie paint?", "answer": "A sunrise", "evidence": ["D1:2"], "category": 4},
            {
                "question": "What did Caroline research, and where did Melanie's kids go camping?",
                "answer": "adoption agencies, mountains",
                "evidence": ["D1:3; D2:1"],
                "category": 1,
            },
            {
                "question": "What did Caroline paint?",
                "adversarial_answer": "A sunrise",
                "evidence": ["D9:99"],
                "category": 5,
            },
        ],
        "observation": {},
        "session_summary": {},
        "event_summary": {},
    }
