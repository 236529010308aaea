from django.db import migrations, models


def from_restored_flag(apps, schema_editor):
    """A turn restored from RAM says so; any other turn that reused tokens found them resident."""
    Turn = apps.get_model("chatapp", "Turn")
    Turn.objects.filter(restored_from_ram=True).update(cache_source="ram")
    Turn.objects.filter(restored_from_ram=False, cached_tokens__gt=0).update(cache_source="resident")


def to_restored_flag(apps, schema_editor):
    Turn = apps.get_model("chatapp", "Turn")
    Turn.objects.filter(cache_source="ram").update(restored_from_ram=True)


class Migration(migrations.Migration):
    dependencies = [("chatapp", "0010_models")]

    operations = [
        migrations.AddField(
            model_name="turn",
            name="cache_source",
            field=models.CharField(
                choices=[
                    ("none", "nothing reused"),
                    ("resident", "resident in the node's context"),
                    ("ram", "restored from the node's RAM"),
                    ("disk", "restored from the node's disk tier"),
                    ("other_node", "restored from another node's disk tier"),
                ],
                default="none",
                max_length=16,
            ),
        ),
        migrations.RunPython(from_restored_flag, to_restored_flag),
        migrations.RemoveField(model_name="turn", name="restored_from_ram"),
    ]
