//! The configurations' common frame: what Burn's `#[derive(Config)]` gives (`new` with
//! the required fields, a `with_` builder per defaulted field, `Clone`, JSON through
//! `Display`, `save` and `load`), except that a field missing from a saved file takes
//! its default, so that the files saved before a field was added still load.

use burn::serde::{Deserialize, Deserializer};

/// A field as a saved file gives it: `None` where the file has no such field (a `null`
/// is a value: `Some(None)` for an `Option` field).
pub(crate) struct Given<T>(pub(crate) Option<T>);

impl<T> Default for Given<T> {
    fn default() -> Self {
        Given(None)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Given<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        T::deserialize(deserializer).map(|value| Given(Some(value)))
    }
}

/// A configuration struct: its required fields (the arguments of `new`, in order), `;`,
/// then each defaulted field as `field: Type = default => with_field`.
macro_rules! config {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $( $(#[$rdoc:meta])* pub $req:ident: $rty:ty, )*
            ;
            $( $(#[$ddoc:meta])* pub $opt:ident: $oty:ty = $default:expr => $with:ident, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, burn::serde::Serialize)]
        #[serde(crate = "burn::serde")]
        pub struct $name {
            $( $(#[$rdoc])* pub $req: $rty, )*
            $( $(#[$ddoc])* pub $opt: $oty, )*
        }

        impl $name {
            /// The configuration of these required fields, every other at its default.
            #[allow(clippy::too_many_arguments, clippy::new_without_default)]
            pub fn new($($req: $rty),*) -> Self {
                Self {
                    $($req,)*
                    $($opt: $default,)*
                }
            }

            $(
                #[doc = concat!("Sets [`", stringify!($opt), "`](Self::", stringify!($opt), ").")]
                pub fn $with(mut self, $opt: $oty) -> Self {
                    self.$opt = $opt;
                    self
                }
            )*
        }

        impl<'de> burn::serde::Deserialize<'de> for $name {
            fn deserialize<D: burn::serde::Deserializer<'de>>(
                deserializer: D,
            ) -> Result<Self, D::Error> {
                #[derive(burn::serde::Deserialize)]
                #[serde(crate = "burn::serde")]
                struct Saved {
                    $( $req: $rty, )*
                    $( #[serde(default)] $opt: $crate::configs::Given<$oty>, )*
                }
                let saved = Saved::deserialize(deserializer)?;
                Ok(Self {
                    $($req: saved.$req,)*
                    $($opt: saved.$opt.0.unwrap_or_else(|| $default),)*
                })
            }
        }

        impl core::fmt::Display for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str(&burn::config::config_to_json(self))
            }
        }

        impl burn::config::Config for $name {}
    };
}

pub(crate) use config;
