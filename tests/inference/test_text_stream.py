from inference.text_stream import TextAssembler


def test_utf8_split_across_tokens_is_joined():
    text = TextAssembler()
    snowman = "☃".encode()
    assert text.add(snowman[:1]) == ""
    assert text.add(snowman[1:]) == "☃"
    assert text.finish() == ""


def test_text_that_may_start_a_stop_string_is_held_back():
    text = TextAssembler(stop=("\nUser:",))
    assert text.add(b"Hello") == ""  # the last 5 characters could begin "\nUser:"
    assert text.add(b" world, how are you today") == "Hello world, how are you "
    assert text.add(b"\nUs") == "tod"
    assert text.add(b"er: next") == "ay"
    assert text.stopped
    assert text.kept_tokens == 2
    assert text.text == "Hello world, how are you today"


def test_finish_returns_the_held_tail():
    text = TextAssembler(stop=("STOP",))
    out = text.add(b"abcdef")
    assert out + text.finish() == "abcdef"
