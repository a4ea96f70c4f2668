from django.apps import AppConfig


class TrainingConfigsConfig(AppConfig):
    name = "training_configs"
    label = "configs"
    verbose_name = "Training configs"
