from django import forms
from django.conf import settings


class MessageForm(forms.Form):
    # The service checks the text (services.check_message_text); the widget only tells the browser the limit.
    text = forms.CharField(
        widget=forms.Textarea(attrs={"maxlength": settings.CHAT_MAX_MESSAGE_CHARS}), strip=False, required=False
    )


class ConversationForm(forms.Form):
    title = forms.CharField(max_length=200, required=False)
