//! Every setting of a tally daemon declared once ([`settings!`](crate::settings!)): its name
//! (the flag `--name-with-dashes`, the file's key `name_with_underscores`), its environment
//! variable, its type, its default and its help. From that one declaration come `Settings`
//! (what a file, the environment or flags gave: each field optional), the merge of one over
//! another (`Settings::overridden_by`), `Values` (every default filled in), the `[default: ...]`
//! of each flag's help ([`with_defaults_in_help`]), and `Settings::defaults` (with
//! `Settings::names` in tests), which each daemon's tests hold its example file to. The
//! aggregator and `tally-server` declare theirs with it, and both take a settings file and raw
//! librdkafka options the same way ([`FileAndKafka`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use tally_common::GroupingRule;

use crate::config::{Store, parse_key_value};

/// How a default is written in the help and in the example file.
pub trait Shown {
    /// The value as a flag would take it.
    fn shown(&self) -> String;
}

macro_rules! shown_by_display {
    ($($t:ty),*) => { $( impl Shown for $t { fn shown(&self) -> String { self.to_string() } } )* };
}
shown_by_display!(String, u32, u64, usize, SocketAddr);

impl Shown for Store {
    fn shown(&self) -> String {
        value_enum_name(self)
    }
}

impl Shown for GroupingRule {
    fn shown(&self) -> String {
        self.as_str().to_owned()
    }
}

/// A value of a `clap::ValueEnum` as a flag takes it (for [`Shown`]).
pub fn value_enum_name(value: &impl clap::ValueEnum) -> String {
    (value.to_possible_value())
        .map(|p| p.get_name().to_owned())
        .unwrap_or_default()
}

/// Declares a daemon's settings: `defaulted` ones have a default, `optional` ones have none (or
/// one that depends on another setting, said in their help). `[...]` holds extra `#[arg]`
/// options. Expands to `Settings`, `Values` and their methods in the calling module, which
/// needs `serde` and `clap` among its crate's dependencies.
#[macro_export]
macro_rules! settings {
    (
        defaulted {
            $( $(#[doc = $doc:literal])* $name:ident: $ty:ty = $default:expr, $env:literal, [$($arg:tt)*]; )*
        }
        optional {
            $( $(#[doc = $odoc:literal])* $oname:ident: $oty:ty, $oenv:literal, [$($oarg:tt)*]; )*
        }
    ) => {
        /// Settings as given by a file, the environment or flags: every field optional.
        #[derive(Debug, Default, Clone, ::serde::Deserialize, ::clap::Args)]
        #[serde(deny_unknown_fields)]
        pub struct Settings {
            $( $(#[doc = $doc])* #[arg(long, env = $env, $($arg)*)] pub $name: Option<$ty>, )*
            $( $(#[doc = $odoc])* #[arg(long, env = $oenv, $($oarg)*)] pub $oname: Option<$oty>, )*
            /// Raw librdkafka options (the file's `[kafka]` table).
            #[arg(skip)]
            #[serde(default)]
            pub kafka: ::std::collections::BTreeMap<String, String>,
        }

        /// Every setting with its default filled in; the optional ones as given.
        #[derive(Debug, Clone)]
        pub struct Values {
            $( $(#[doc = $doc])* pub $name: $ty, )*
            $( $(#[doc = $odoc])* pub $oname: Option<$oty>, )*
            /// Raw librdkafka options.
            pub kafka: ::std::collections::BTreeMap<String, String>,
        }

        impl Settings {
            /// Reads settings from a TOML file.
            pub fn from_file(path: &::std::path::Path) -> Result<Self, $crate::ConfigError> {
                $crate::config::read_toml(path)
            }

            /// The settings file `given` names (if any) under `flags` (the environment's and the
            /// command line's), with `given`'s Kafka options over those, and `secret_kafka`
            /// (the credentials' librdkafka options) over all.
            pub fn layered(
                given: &$crate::settings::FileAndKafka,
                flags: Settings,
                secret_kafka: &::std::collections::BTreeMap<String, String>,
            ) -> Result<Self, $crate::ConfigError> {
                let base = match &given.config {
                    Some(path) => Self::from_file(path)?,
                    None => Self::default(),
                };
                let mut over = flags;
                over.kafka.extend(given.kafka_options.iter().cloned());
                over.kafka.extend(secret_kafka.clone());
                Ok(base.overridden_by(over))
            }

            /// These settings, with every field that `over` sets replaced by its value (and
            /// `over`'s Kafka options added over these).
            pub fn overridden_by(mut self, over: Settings) -> Self {
                $( if over.$name.is_some() { self.$name = over.$name; } )*
                $( if over.$oname.is_some() { self.$oname = over.$oname; } )*
                self.kafka.extend(over.kafka);
                self
            }

            /// Every default filled in.
            pub fn values(self) -> Values {
                Values {
                    $( $name: self.$name.unwrap_or_else(|| $default), )*
                    $( $oname: self.$oname, )*
                    kafka: self.kafka,
                }
            }

            /// Each setting that has a default, with the default as a flag takes it.
            pub fn defaults() -> Vec<(&'static str, String)> {
                use $crate::settings::Shown as _;
                vec![ $( (stringify!($name), { let d: $ty = $default; d }.shown()), )* ]
            }

            /// Every setting's name, as the file spells it (for the checks of an example file).
            #[cfg(test)]
            pub fn names() -> Vec<&'static str> {
                vec![ $( stringify!($name), )* $( stringify!($oname), )* ]
            }
        }
    };
}

/// `command` with `[default: ...]` added to the help of each setting of `defaults`.
pub fn with_defaults_in_help(
    command: clap::Command,
    defaults: &[(&'static str, String)],
) -> clap::Command {
    command.mut_args(|arg| {
        let id = arg.get_id().as_str();
        match defaults.iter().find(|(name, _)| *name == id) {
            Some((_, value)) => {
                let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
                arg.help(format!("{help} [default: {value}]"))
            }
            None => arg,
        }
    })
}

/// `--config` and `--kafka-option`: a settings file under the environment and the flags, and raw
/// librdkafka options over the file's `[kafka]` table, as every tally daemon takes them.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct FileAndKafka {
    /// TOML file of settings (same names as the flags, with underscores); flags and TALLY_*
    /// variables override it.
    #[arg(long, env = "TALLY_CONFIG")]
    pub config: Option<PathBuf>,
    /// A raw librdkafka option for the program's Kafka clients, key=value; repeatable.
    #[arg(long = "kafka-option", env = "TALLY_KAFKA_OPTIONS", hide_env_values = true, value_delimiter = ',', value_parser = parse_key_value)]
    pub kafka_options: Vec<(String, String)>,
}

impl FileAndKafka {
    /// Refuses credentials given on the command line of `matches`: in a Kafka option, or in the
    /// settings' Redis or PostgreSQL URL (`crate::secrets::refuse_secret_flags`).
    pub fn refuse_secret_flags(
        &self,
        redis_url: Option<&str>,
        postgres_url: Option<&str>,
        matches: &clap::ArgMatches,
    ) -> Result<(), crate::ConfigError> {
        let from_command_line =
            |id: &str| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        crate::secrets::refuse_secret_flags(
            &self.kafka_options,
            redis_url,
            postgres_url,
            from_command_line,
        )
    }
}

/// What an example settings file gets wrong against a declaration: every setting of `names`
/// must appear (`name = `; those without a default may be commented out), and each of
/// `defaults` must be set, to its default. Empty when it follows the declaration.
pub fn example_mismatches(
    text: &str,
    names: &[&'static str],
    defaults: &[(&'static str, String)],
) -> Vec<String> {
    let table: toml::Table = match toml::from_str(text) {
        Ok(table) => table,
        Err(e) => return vec![format!("not TOML: {e}")],
    };
    let mut wrong = Vec::new();
    for name in names {
        if !text.contains(&format!("{name} = ")) {
            wrong.push(format!("{name} is missing"));
        }
    }
    for (name, default) in defaults {
        match table.get(*name) {
            None => wrong.push(format!("{name} is commented out, though it has a default")),
            Some(toml::Value::String(s)) if s == default => {}
            Some(value) if value.to_string() == *default => {}
            Some(value) => wrong.push(format!("{name} is {value}, its default is {default}")),
        }
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;

    mod declared {
        crate::settings! {
            defaulted {
                /// A number
                count: u32 = 7, "TALLY_TEST_COUNT", [];
                /// A name
                name: String = "x".to_owned(), "TALLY_TEST_NAME", [];
            }
            optional {
                /// A path [default: none]
                path: std::path::PathBuf, "TALLY_TEST_PATH", [];
            }
        }
    }

    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(flatten)]
        common: FileAndKafka,
        #[command(flatten)]
        settings: declared::Settings,
    }

    #[test]
    fn one_declaration_gives_fields_merge_defaults_and_help() {
        use clap::{CommandFactory, Parser};
        let dir = std::env::temp_dir().join(format!("tally-ops-settings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("t.toml");
        std::fs::write(
            &file,
            "count = 3\nname = \"file\"\n[kafka]\na = \"file\"\nb = \"file\"\nc = \"file\"\n",
        )
        .expect("written");
        let path = file.to_str().expect("utf-8");
        let cli = Cli::try_parse_from([
            "t",
            "--config",
            path,
            "--name",
            "flag",
            "--kafka-option",
            "b=flag,c=flag",
        ])
        .expect("parses");
        let secret = [("c".to_owned(), "secret".to_owned())].into();
        let values = declared::Settings::layered(&cli.common, cli.settings, &secret)
            .expect("layered")
            .values();
        assert_eq!((values.count, values.name.as_str()), (3, "flag"));
        assert_eq!(values.path, None);
        let kafka: Vec<(&str, &str)> = (values.kafka.iter())
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(kafka, [("a", "file"), ("b", "flag"), ("c", "secret")]);
        assert_eq!(declared::Settings::default().values().count, 7);
        assert_eq!(
            declared::Settings::defaults(),
            [("count", "7".to_owned()), ("name", "x".to_owned())]
        );
        assert_eq!(declared::Settings::names(), ["count", "name", "path"]);
        let help = with_defaults_in_help(Cli::command(), &declared::Settings::defaults())
            .render_help()
            .to_string();
        assert!(help.contains("A number [default: 7]"), "{help}");
        assert!(toml::from_str::<declared::Settings>("cuont = 1").is_err());
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn an_example_file_is_held_to_the_declaration() {
        let (names, defaults) = (declared::Settings::names(), declared::Settings::defaults());
        let check = |text: &str| example_mismatches(text, &names, &defaults);
        assert!(check("count = 7\nname = \"x\"\n# path = \"/p\"\n").is_empty());
        assert_eq!(
            check("count = 8\n# name = \"x\"\n"),
            [
                "path is missing",
                "count is 8, its default is 7",
                "name is commented out, though it has a default"
            ]
        );
    }
}
