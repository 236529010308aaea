from collections.abc import Mapping

from django import forms
from django.conf import settings

from chatapp.memory.registry import strategy_aliases
from inference.model_files import PACKAGED
from router.services import served_models


class MessageForm(forms.Form):
    # The service checks the text (validation.check_message_text); the widget only tells the browser the limit.
    text = forms.CharField(
        widget=forms.Textarea(attrs={"maxlength": settings.CHAT_MAX_MESSAGE_CHARS}), strip=False, required=False
    )


class ConversationForm(forms.Form):
    title = forms.CharField(max_length=200, required=False)
    strategy = forms.ChoiceField(choices=(), required=False, help_text="What of the history is resent each turn.")
    model = forms.ChoiceField(choices=(), required=False, help_text="Which model answers.")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        strategy = self.fields["strategy"]
        assert isinstance(strategy, forms.ChoiceField)
        strategy.choices = [(alias, alias) for alias in strategy_aliases()]
        strategy.initial = settings.CHAT_DEFAULT_STRATEGY
        model = self.fields["model"]
        assert isinstance(model, forms.ChoiceField)
        model.choices = model_choices(served_models())
        model.initial = settings.CHAT_DEFAULT_MODEL


def model_choices(served: Mapping[str, object], *, current: str = "") -> list[tuple[str, str]]:
    """Every model known here (and `current`), those no node serves now marked as such."""
    names = sorted(set(PACKAGED) | set(served) | ({current} if current else set()))
    return [(name, name if name in served else f"{name} (no node up)") for name in names]


class FactForm(forms.Form):
    text = forms.CharField(max_length=500, widget=forms.TextInput(attrs={"placeholder": "Something to remember"}))
